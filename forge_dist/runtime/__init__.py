"""Runtime: plan/run, ahead-of-time kernels and the static dispatcher (DESIGN.md section 7).

* :func:`plan` (:mod:`.plan`): fix shapes, dtypes, strategy, tiles, kernels and buffers
  once; ``Plan.run`` only checks tensors against the plan and launches.
* :mod:`.cache`: an LRU of plans keyed by their signature (``cache.get(op, **kw)``).
* :mod:`.programs`: the launch programs (one source for plans, AOT and the dispatcher).
* :mod:`.aot`: compile the kernels for ``cuda:90`` without a GPU into an on-disk cubin
  cache with a manifest; stale or mismatched entries are detected and rebuilt.
* :mod:`.dispatcher`: load cubins and launch them through the CUDA driver API.
* :mod:`.compile_cli`: ``forge-dist compile --config FILE [--cache-dir DIR] [--target T]``.

Notes on CUDA graphs: single-rank plans are capturable (see :mod:`.plan`), and so are
sequence-parallel forge plans: the forge chain kernel reads its channel epoch from a device
counter that it advances itself (:mod:`forge_dist.comm.channel`), so each replay waits for
that replay's signals.  Run the plan once eagerly before capturing (the forge channel is
allocated at plan time; the first run warms Triton) and call ``forge_dist.sp.forge.flush()``
after replays to surface a timeout.
"""
from .plan import Plan, PlanError, plan

__all__ = ["Plan", "PlanError", "plan"]

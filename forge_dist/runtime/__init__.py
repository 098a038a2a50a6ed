"""Runtime: plan/run, ahead-of-time kernels and the static dispatcher (docs/design.md section 7).

* :func:`plan` (:mod:`.planner`): fix shapes, dtypes, strategy, tiles, kernels and buffers
  once; :meth:`Plan.run <.plan.Plan.run>` only checks tensors against the plan and launches
  (:mod:`.executor` runs the launch programs; :mod:`.sp_setup` the sequence-parallel part).
* :mod:`.front`: what a plan calls back into :mod:`forge_dist.ops` for, registered by it.
* :mod:`.cache`: an LRU of plans keyed by their signature (``cache.get(op, **kw)``).
* the launch programs are the kernel modules' (:func:`forge_dist.kernels.forward_program`,
  :mod:`forge_dist.kernels.ir`): one source for the eager path, plans, AOT and the dispatcher.
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
from .plan import Plan, PlanError
from .planner import plan

__all__ = ["Plan", "PlanError", "plan"]

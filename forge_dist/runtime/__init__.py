"""Runtime: plan/run, ahead-of-time kernels and the static dispatcher (DESIGN.md section 7).

* :func:`plan` (:mod:`.plan`): fix shapes, dtypes, strategy, tiles, kernels and buffers
  once; ``Plan.run`` only checks tensors against the plan and launches.
* :mod:`.cache`: an LRU of plans keyed by their signature (``cache.get(op, **kw)``).
* :mod:`.programs`: the launch programs (one source for plans, AOT and the dispatcher).
* :mod:`.aot`: compile the kernels for ``cuda:90`` without a GPU into an on-disk cubin
  cache with a manifest; stale or mismatched entries are detected and rebuilt.
* :mod:`.dispatcher`: load cubins and launch them through the CUDA driver API.
* :mod:`.compile_cli`: ``forge-dist compile --config FILE [--cache-dir DIR] [--target T]``.

Notes on CUDA graphs: single-rank plans are capturable (see :mod:`.plan`).  A
sequence-parallel forge plan is not yet replay-safe: the forge chain kernel receives its
channel epoch as a host scalar (``Channel.next_epoch()``), so every replay of a captured
call reuses the captured epoch; from the second replay on, a rank's wait for
``signal >= 2 * epoch`` is already satisfied by the previous replay and it may read a
stale tile.  The fix (a device-side epoch counter) belongs in ``forge_dist/sp/forge.py``;
``tests/runtime/test_gpu.py::test_forge_graph_replays`` checks it with changing inputs.
"""
from .plan import Plan, PlanError, plan

__all__ = ["Plan", "PlanError", "plan"]

"""Load: many back-to-back calls with shapes, ops, strategies, layouts from a bounded set at
2 gloo ranks: every result right (no stale state), no growth of the Python heap
(tracemalloc) or RSS after warm-up, no growth of the work a call does (Python calls and aten
ops, counted: a deterministic stand-in for "no slow-down" that a loaded CI machine cannot
upset; the wall times are checked only in the long logged run).  And memory per rank of the state pass:
serial / pipelined / forge hold O(1) states whatever the number of ranks, lasp2 O(P)."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

from . import load_worker as lw
from ._world import spawn

LOG = (Path(__file__).resolve().parents[2] / "scaling_benchmarks" / "results" / "logs"
       / "robustness_load_cpu.log")


def _check(res, wall_time=False):
    assert res["max_rel_err"] < 1e-10, res
    assert res["py_heap_end_kb"] - res["py_heap_warm_kb"] < 256, res
    assert res["rss_end_mb"] - res["rss_warm_mb"] < 32, res
    for shape, early, late in zip(lw.SHAPES, res["work_early"], res["work_late"]):
        assert late == early, (shape, early, late)
    if wall_time:
        assert res["late_ms"] < 1.5 * res["early_ms"] + 5, res


def test_back_to_back_calls_two_ranks():
    res = spawn(2, lw.load, 84, 14, deadline_s=200)
    for r in res:
        _check(r)


@pytest.mark.slow
def test_back_to_back_calls_two_ranks_long():
    """The logged run: ``FORGE_DIST_SLOW=1 pytest tests/robustness/test_load.py -k long``."""
    t0 = time.time()
    res = spawn(2, lw.load, 2100, 70, deadline_s=1800)
    with open(LOG, "w") as f:
        f.write(f"# robustness load run (tests/robustness/test_load.py), torch "
                f"{torch.__version__}, gloo, 2 ranks, {os.cpu_count()} CPUs, "
                f"{time.time() - t0:.0f}s wall\n# shapes cycled: {lw.SHAPES}\n")
        for r, x in enumerate(res):
            f.write(f"rank {r}: {json.dumps(x)}\n")
    for r in res:
        _check(r, wall_time=True)


@pytest.fixture(scope="module")
def state_bytes():
    return {P: spawn(P, lw.state_pass_bytes, deadline_s=120) for P in (3, 4)}


@pytest.mark.parametrize("kind", ["scalar", "dense"])
def test_state_pass_memory_constant_except_lasp2(state_bytes, kind):
    worst = {P: {s: max(r[kind][s] for r in ranks) for s in ("serial", "pipelined", "lasp2")}
             for P, ranks in state_bytes.items()}
    state = state_bytes[3][0][kind]["state_bytes"]
    for s in ("serial", "pipelined"):
        assert worst[4][s] == worst[3][s], worst
        # the signature trailer costs one more state-sized send buffer (the payload with
        # its trailer) than the pass did before it travelled with the state
        assert worst[4][s] <= 16 * state, worst
    # lasp2 gathers every rank's summary (and, in backward, every rank's gradient)
    assert worst[4]["lasp2"] - worst[3]["lasp2"] >= 2 * state, worst


def test_forge_channel_memory_per_rank_does_not_grow():
    from forge_dist.comm.sim import SimWorld

    per_rank = {}
    for P in (2, 3, 4):
        world = SimWorld(P)
        for direction in ("fwd", "bwd"):
            world.channels((direction,), 16, 2048, torch.float32)
        total = sum(t.numel() * t.element_size() for chans in world._channels.values()
                    for ch in chans for t in (ch.recv, ch.send, ch.sig, ch.ack, ch.err))
        per_rank[P] = total / P
    assert per_rank[2] == per_rank[3] == per_rank[4], per_rank

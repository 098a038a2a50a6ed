"""Every op x strategy x world size (1-4) x fp64/fp32 x dense/packed, forward and backward,
against the single-process fp64 recurrence (outputs, final states, every gradient).

One rank never passes a state, so world size 1 runs each case once (the strategy is not
used there).  The Triton kernels (``TRITON_INTERPRET=1``) run across three ranks for serial,
pipelined and forge (its simulated transport, fp32: the local work in the kernels too) here,
and for lasp2 in tests/sp/test_kernel_path_gloo.py."""
import functools

import pytest
import torch

from forge_dist.selftest import OPS, STRATEGIES, matrix_rows, run_case, tolerance

from .distributed import run_world

WORLDS = (1, 2, 3, 4)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
ONE_RANK = "auto"  # what a one-rank call passes; no strategy runs
CASES = [(w, s) for w in WORLDS for s in (STRATEGIES if w > 1 else (ONE_RANK,))]
KERNEL_ENV = {"TRITON_INTERPRET": "1", "FORGE_DIST_KERNELS": "triton",
              "FORGE_DIST_TIMEOUT": "120"}
# The interpreter is slow: one layout per strategy (packed sequences straddling the ranks
# through serial's hops, dense through pipelined's tiles), both for forge (cheap: about 20 s);
# lasp2 runs both elsewhere.
KERNEL_CASES = (("serial", True), ("pipelined", False), ("forge", True), ("forge", False))


def _rows(group, strategies):
    return matrix_rows(group, strategies=list(strategies))


@functools.lru_cache(maxsize=None)
def results_for(world: int):
    strategies = STRATEGIES if world > 1 else (ONE_RANK,)
    rows = run_world(world, _rows, strategies, env={"FORGE_DIST_TIMEOUT": "120"})
    return {(r["op"], r["strategy"], r["dtype"], r["varlen"]): r for r in rows}


def _check(row, dtype):
    tol = tolerance(DTYPES[dtype])
    bad = {k: v for k, v in row["errors"].items() if not v <= tol}
    assert not bad, f"relative RMSE above {tol:g}: {bad}"
    # Every gradient the op has must have been compared.
    assert {"o", "final_state", "d_initial_state"} <= set(row["errors"])


@pytest.mark.parametrize("world,strategy", CASES, ids=[f"world{w}-{s}" for w, s in CASES])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_matches_reference(world, strategy, op, dtype, varlen):
    _check(results_for(world)[(op, strategy, dtype, varlen)], dtype)


def _kernel_rows(group):
    from forge_dist.ops import attention

    assert attention._use_kernels(torch.device("cpu")), "the kernel path is not selected"
    return [run_case(op, strategy, torch.float32, varlen, group=group, T_local=40,
                     dims=(16, 16, 16)).as_dict()
            for strategy, varlen in KERNEL_CASES for op in OPS]


@functools.lru_cache(maxsize=None)
def kernel_results():
    rows = run_world(3, _kernel_rows, env=KERNEL_ENV)
    return {(r["op"], r["strategy"], r["varlen"]): r for r in rows}


@pytest.mark.parametrize("strategy,varlen", KERNEL_CASES,
                         ids=[f"{s}-{'packed' if v else 'dense'}" for s, v in KERNEL_CASES])
@pytest.mark.parametrize("op", OPS)
def test_kernel_path_matches_reference(strategy, varlen, op):
    pytest.importorskip("triton")
    _check(kernel_results()[(op, strategy, varlen)], "float32")

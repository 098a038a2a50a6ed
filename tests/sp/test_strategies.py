"""Every op x strategy x world size (1-4) x fp64/fp32 x dense/packed, forward and backward,
against the single-process fp64 recurrence (outputs, final states, every gradient)."""
import functools

import pytest
import torch

from forge_dist.selftest import OPS, STRATEGIES, matrix_rows, tolerance

from .distributed import run_world

WORLDS = (1, 2, 3, 4)
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@functools.lru_cache(maxsize=None)
def results_for(world: int):
    rows = run_world(world, matrix_rows, env={"FORGE_DIST_TIMEOUT": "120"})
    return {(r["op"], r["strategy"], r["dtype"], r["varlen"]): r for r in rows}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_matches_reference(world, op, strategy, dtype, varlen):
    row = results_for(world)[(op, strategy, dtype, varlen)]
    tol = tolerance(DTYPES[dtype])
    bad = {k: v for k, v in row["errors"].items() if not v <= tol}
    assert not bad, f"relative RMSE above {tol:g}: {bad}"
    # Every gradient the op has must have been compared.
    assert {"o", "final_state", "d_initial_state"} <= set(row["errors"])

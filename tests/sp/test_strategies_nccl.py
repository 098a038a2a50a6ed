"""The strategy matrix of test_strategies.py over NCCL, one process per GPU (2 GPUs)."""
import functools

import pytest
import torch

from forge_dist.selftest import OPS, STRATEGIES, matrix_rows, tolerance

from .distributed import run_world

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@functools.lru_cache(maxsize=None)
def nccl_results():
    rows = run_world(2, matrix_rows, env={"FORGE_DIST_TIMEOUT": "120"}, backend="nccl",
                     kwargs_device="cuda")
    return {(r["op"], r["strategy"], r["dtype"], r["varlen"]): r for r in rows}


@pytest.mark.multigpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_matches_reference_over_nccl(op, strategy, dtype, varlen):
    row = nccl_results()[(op, strategy, dtype, varlen)]
    tol = tolerance(DTYPES[dtype])
    bad = {k: v for k, v in row["errors"].items() if not v <= tol}
    assert not bad, f"relative RMSE above {tol:g}: {bad}"


def _kernel_matrix(group, device):
    """Head dims >= 16 route CUDA tensors through the Triton kernels (fp32 dots use TF32)."""
    return matrix_rows(group, device=device, dtypes=(torch.float32,), T_local=96,
                       dims=(32, 48, 64))


@pytest.mark.multigpu
def test_kernel_path_over_nccl():
    rows = run_world(2, _kernel_matrix, env={"FORGE_DIST_TIMEOUT": "120"}, backend="nccl",
                     kwargs_device="cuda")
    assert len(rows) == len(OPS) * len(STRATEGIES) * 2
    bad = [(r["op"], r["strategy"], r["varlen"], r["errors"]) for r in rows
           if not max(r["errors"].values()) <= 3e-3]
    assert not bad, bad

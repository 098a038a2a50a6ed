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


@pytest.mark.multigpu
def test_kernel_path_over_nccl(tmp_path):
    """The Triton-kernel path over NCCL, launched with torchrun (see kernel_path_worker.py).

    A failure shows every rank's own log: the worker's watchdog dumps the stacks of a case
    that stalls, and a rank that fails says which case and why."""
    from pathlib import Path

    from tests.torchrun_workers import rank_logs, torchrun

    worker = Path(__file__).with_name("kernel_path_worker.py")
    rc, lines = torchrun(worker, [], 2, tmp_path / "logs", timeout_s=1200)
    out = "".join(lines)
    assert rc == 0, f"torchrun rc={rc}\n{rank_logs(tmp_path / 'logs')}"
    assert out.count("max_rel_err=") == len(OPS) * 2, out

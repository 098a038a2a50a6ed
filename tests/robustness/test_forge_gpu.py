"""forge under load and faults on real GPUs: runs tests/robustness/forge_gpu_worker.py under
torchrun on 2 GPUs and checks every rank's report (10,000 back-to-back calls over a bounded
set of shapes with no stale signal, no memory growth and no slow-down; bitwise determinism
of every op; a stall before sending, in backward and in the middle of a tile stream, each
named by the waiting neighbour within the bound and recovered from with ``forge.reset``; a
rank that dies, named by its neighbour).  Set ``FORGE_DIST_REPORT_DIR`` to keep the reports
(the device batch copies them under scaling_benchmarks/results/logs)."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.torchrun_workers import ROOT, run_workers

WORLD = 2
CHECKS = ["available", "load", "determinism", "stall_fwd", "stall_bwd", "cut_mid_stream",
          "lag", "crash"]

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD,
                                 reason=f"needs {WORLD} CUDA devices")]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("forge_robust")
    got, lines = run_workers(ROOT / "tests" / "robustness" / "forge_gpu_worker.py", out, WORLD)
    keep = os.environ.get("FORGE_DIST_REPORT_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        for path in out.glob("rank*.json"):
            shutil.copy(path, Path(keep) / f"forge_gpu_robustness_{path.name}")
        Path(keep, "forge_gpu_robustness.log").write_text("".join(lines))
    return got


@pytest.mark.parametrize("name", CHECKS)
def test_forge_gpu_robustness(reports, name):
    for r, rep in reports.items():
        assert name in rep, f"rank {r} did not run {name}: {sorted(rep)}"
        assert rep[name]["ok"], f"rank {r} {name}: {rep[name]['detail']}"

"""forge under load and faults on real GPUs: runs tests/robustness/forge_gpu_worker.py under
torchrun on 2 GPUs and checks every rank's report (10,000 back-to-back calls over a bounded
set of shapes with no stale signal, no memory growth and no slow-down; bitwise determinism
of every op; a stall before sending, in backward and in the middle of a tile stream, each
named by the waiting neighbour within the bound and recovered from with ``forge.reset``; a
rank that dies, named by its neighbour).  Set ``FORGE_DIST_REPORT_DIR`` to keep the reports
(the device batch copies them under scaling_benchmarks/results/logs)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
CHECKS = ["available", "load", "determinism", "stall_fwd", "stall_bwd", "cut_mid_stream",
          "crash"]

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD,
                                 reason=f"needs {WORLD} CUDA devices")]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("forge_robust")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           str(ROOT / "tests" / "robustness" / "forge_gpu_worker.py"), str(out)]
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        try:
            for line in proc.stdout:  # streamed: a killed run still shows how far it got
                lines.append(line)
                sys.__stderr__.write(line)
                sys.__stderr__.flush()
            proc.wait(timeout=600)
        except BaseException:
            proc.kill()
            raise
    keep = os.environ.get("FORGE_DIST_REPORT_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        for path in out.glob("rank*.json"):
            shutil.copy(path, Path(keep) / f"forge_gpu_robustness_{path.name}")
        Path(keep, "forge_gpu_robustness.log").write_text("".join(lines))
    tail = "".join(lines)[-4000:]
    got = {}
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report; rc={proc.returncode}\n{tail}"
        got[r] = json.loads(path.read_text())
    return got


@pytest.mark.parametrize("name", CHECKS)
def test_forge_gpu_robustness(reports, name):
    for r, rep in reports.items():
        assert name in rep, f"rank {r} did not run {name}: {sorted(rep)}"
        assert rep[name]["ok"], f"rank {r} {name}: {rep[name]['detail']}"

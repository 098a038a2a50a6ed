"""forge on real GPUs: launches tests/comm/multigpu_worker.py under torchrun once and checks
every rank's report (chains per kind, every op fwd+bwd against serial/lasp2/single GPU,
1000 back-to-back calls, the timeout error).  Skipped without two CUDA devices."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["available", "chains_identity", "chains_scalar", "chains_diagonal", "chains_dense",
          "chains_dense_K64_V96", "op_linear_attn", "op_simple_gla", "op_gla",
          "op_gated_delta_rule", "op_hgrn", "back_to_back", "timeout"]
WORLD = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("forge_mg")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           str(ROOT / "tests" / "comm" / "multigpu_worker.py"), str(out)]
    # The worker's lines go to the real stderr as they come (pytest's capture would hold
    # them until the end, and a killed run would show nothing) and are kept for the report.
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        try:
            for line in proc.stdout:
                lines.append(line)
                sys.__stderr__.write(line)
                sys.__stderr__.flush()
            proc.wait(timeout=600)
        except BaseException:
            proc.kill()
            raise
    tail = "".join(lines)[-4000:]
    got = {}
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report; rc={proc.returncode}\n{tail}"
        got[r] = json.loads(path.read_text())
    return got


@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", CHECKS)
def test_forge_multigpu(reports, name):
    for r, rep in reports.items():
        assert name in rep, f"rank {r} did not run {name}: {sorted(rep)}"
        assert rep[name]["ok"], f"rank {r} {name}: {rep[name]['detail']}"

"""Launch a multi-GPU worker script under torchrun and collect its per-rank JSON reports.

The worker's lines go to the real stderr as they come (pytest's capture would hold them
until the end, and a killed run would show nothing) and are kept for the failure message.
Used by the ``multigpu`` tests (tests/sp/test_forge_multigpu.py,
tests/robustness/test_forge_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# NVLink multicast off everywhere (see docs/design.md, section 4)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def run_workers(script: Path, out: Path, world: int, timeout_s: float = 600):
    """Run ``torchrun --nproc_per_node=world script out``; returns ``(reports, lines)``
    where ``reports[r]`` is ``out/rank<r>.json`` (an assertion names a missing one)."""
    env = dict(os.environ, **NO_MULTICAST,
               PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           str(script), str(out)]
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        try:
            for line in proc.stdout:
                lines.append(line)
                sys.__stderr__.write(line)
                sys.__stderr__.flush()
            proc.wait(timeout=timeout_s)
        except BaseException:
            proc.kill()
            raise
    tail = "".join(lines)[-4000:]
    reports = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report; rc={proc.returncode}\n{tail}"
        reports[r] = json.loads(path.read_text())
    return reports, lines

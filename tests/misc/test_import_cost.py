"""Importing the ops stays cheap on a CPU machine: what a call may never need is not imported
with them (torch's NVSHMEM and inductor modules, the kernels of the patterns, the
benchmarks).  Measured (2 cores, 2026-11-27): ``import forge_dist.ops`` after ``import torch``
0.18-0.21 s, of which Triton's own import is about 0.12 s; 0.22-0.25 s before the pattern
kernels were left out."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NEVER = ("torch._inductor", "torch.distributed._symmetric_memory", "scaling_benchmarks",
         "forge_dist.kernels.walker", "forge_dist.kernels.delta",
         "forge_dist.kernels.delta_backward", "forge_dist.kernels.scalar",
         "forge_dist.kernels.scalar_backward", "forge_dist.kernels.vector",
         "forge_dist.kernels.vector_backward", "forge_dist.kernels.vector_state",
         "forge_dist.dsl", "forge_dist.nn")


def _modules_after(statement: str) -> list:
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys, json; "
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_the_ops_loads_no_kernels_or_compilers():
    loaded = _modules_after("import forge_dist.ops")
    bad = [m for m in loaded if any(m == n or m.startswith(n + ".") for n in NEVER)]
    assert not bad, bad


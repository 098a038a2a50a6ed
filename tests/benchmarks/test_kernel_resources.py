"""scaling_benchmarks/kernel_resources.py: the kernel list and one real sm_90 compile with the
ptxas report (in a child process: the test session runs Triton's interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_lists_every_pattern_forward_and_backward():
    from scaling_benchmarks import kernel_resources

    got = {(op, pas) for op, pas, _ in kernel_resources.specs(64, 64, 2, 256)}
    for op in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
        assert (op, "fwd") in got, op
    for op in ("simple_gla", "gla", "gated_delta_rule", "hgrn"):
        assert (op, "bwd") in got, op


def test_one_kernel_compiles_and_reports(tmp_path):
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    code = ("import json, sys; from scaling_benchmarks import kernel_resources as kr; "
            "r = kr.measure(64, 64, 2, 256, only=lambda op, p, s: op == 'hgrn' and p == 'bwd'); "
            "kr.plot(r, __import__('pathlib').Path(sys.argv[1]) / 'r.png'); "
            "print(json.dumps(r['rows']))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 2  # the backward walk with and without the gradients
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0 and r["fits"], r
    assert (tmp_path / "r.png").stat().st_size > 0

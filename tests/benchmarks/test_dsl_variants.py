"""dsl_variants.py on the CPU: the one-device rows and the sequence-parallel rows (gloo
processes, tiny shapes: the code path, not timings)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from .._spawn import subprocess_env

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra):
    env = subprocess_env(dict(os.environ, TRITON_INTERPRET="1", FORGE_DIST_COMMIT="test"))
    return subprocess.run([sys.executable, "-m", "scaling_benchmarks.dsl_variants", "--device",
                           "cpu", "--out", str(tmp_path), *extra], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO)


def _result(tmp_path, prefix):
    files = sorted(tmp_path.glob(f"{prefix}_*.json"))
    assert len(files) == 1, files
    assert files[0].with_suffix(".png").stat().st_size > 5_000
    return json.loads(files[0].read_text())


def test_one_device_rows_name_their_path_and_target(tmp_path):
    proc = _run(tmp_path, "--T", "64", "--heads", "2", "--variants",
                "gate_named_a,strict_readout")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _result(tmp_path, "dsl_variants")["rows"] if r["impl"] == "dsl"]
    assert [(r["op"], r["path"], r["target"]) for r in rows] == [
        ("gate_named_a", "template:simple_gla", 1.2),
        ("strict_readout", "residual:simple_gla", 3.0)]  # no template fits the program
    assert all(r["ms"] > 0 and r["ratio"] > 0 for r in rows)


def test_sequence_parallel_rows_compare_each_variant_with_its_builtin(tmp_path):
    proc = _run(tmp_path, "--sp", "--world", "2", "--variants", "gate_named_a,strict_readout")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = _result(tmp_path, "dsl_variants_sp")
    assert data["world_size"] == 2 and data["config"]["strategy"] == "forge"
    rows = data["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [
        ("gate_named_a", "dsl"), ("gate_named_a", "builtin"),
        ("strict_readout", "dsl"), ("strict_readout", "builtin")]
    for dsl, builtin in (rows[:2], rows[2:]):
        assert "skipped" not in dsl and "skipped" not in builtin, (dsl, builtin)
        assert dsl["ratio"] == dsl["ms"] / dsl["shard_ms"] and len(dsl["per_rank"]) == 2
        assert dsl["builtin_ratio"] == builtin["ratio"]
        assert dsl["meets_target"] == (dsl["ratio"] <= builtin["ratio"])


def test_sequence_parallel_without_a_launcher_is_told_how_to_start(tmp_path):
    proc = _run(tmp_path, "--sp", "--variants", "gate_named_a")
    assert proc.returncode == 2 and "torchrun" in proc.stderr and "--world" in proc.stderr

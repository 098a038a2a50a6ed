"""layers.py --sp on the CPU (gloo processes, fp32, 32 tokens per rank): rows, errors, files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .._spawn import subprocess_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scaling_benchmarks" / "layers.py"


def _run(tmp_path, *extra):
    # the tests' faster interpreter in the script and its ranks (bitwise Triton's values)
    env = subprocess_env(dict(os.environ, TRITON_INTERPRET="1", FORGE_DIST_COMMIT="test"))
    return subprocess.run([sys.executable, str(SCRIPT), "--sp", "--cpu", "--out", str(tmp_path),
                           *extra], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("layers_sp")
    proc = _run(out, "--world", "2", "--layers", "gla,gdn", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.glob("layers_sp_*.json"))
    assert len(files) == 1, files
    assert files[0].with_suffix(".png").stat().st_size > 10_000
    return json.loads(files[0].read_text())


def test_every_layer_and_pass_has_a_row(two_ranks):
    assert two_ranks["world_size"] == 2 and two_ranks["config"]["tokens_per_gpu"] == 32
    rows = two_ranks["rows"]
    assert [(r["layer"], r["pass"]) for r in rows] == [
        ("gla", "fwd"), ("gla", "fwdbwd"), ("gdn", "fwd"), ("gdn", "fwdbwd")]
    for r in rows:
        assert "skipped" not in r, r
        assert r["strategy"] == "forge" and r["world_size"] == 2
        assert r["ms"] > 0 and r["shard_ms"] > 0
        assert len(r["per_rank"]) == 2


def test_sequence_parallel_layers_equal_the_whole_sequence(two_ranks):
    # fp32: the outputs, dx and every parameter gradient (summed over ranks) against the
    # layer on the whole sequence; a rank that dropped its incoming state is off by O(1)
    for r in two_ranks["rows"]:
        assert r["max_rel_err"] < 1e-4, r


def test_one_process_without_a_launcher_is_told_how_to_start(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 2 and "torchrun" in proc.stderr and "--world" in proc.stderr


def test_unknown_layer_is_named(tmp_path):
    proc = _run(tmp_path, "--layers", "gla,nope")
    assert proc.returncode == 2
    assert "--layers" in proc.stderr and "nope" in proc.stderr


def test_a_failed_row_is_recorded_and_the_next_runs(tmp_path):
    # 2 tokens per rank: GatedDeltaNet's convolution halo (3 tokens) does not fit, and every
    # rank says so; the next layer runs on a new group
    proc = _run(tmp_path, "--world", "2", "--layers", "gdn,gla", "--passes", "fwd",
                "--tokens-per-gpu", "2", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("layers_sp_*.json")).read_text())["rows"]
    assert [r["layer"] for r in rows] == ["gdn", "gla"]
    assert "convolution halo" in rows[0]["skipped"], rows[0]
    assert "skipped" not in rows[1] and rows[1]["max_rel_err"] < 1e-4, rows[1]


def test_bf16_rows_hold_the_sequence_parallel_error_to_one_devices(tmp_path):
    # bf16: the errors against the same weights in fp32 on the whole sequence; the
    # sequence-parallel result must be as exact as one device's (a state or a gradient sum
    # rounded to bf16 on the way between ranks would add its own error on top)
    proc = _run(tmp_path, "--world", "2", "--layers", "gdn", "--passes", "fwdbwd",
                "--repeats", "1", "--cpu-dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(next(tmp_path.glob("layers_sp_*.json")).read_text())
    assert data["config"]["dtype"] == "bfloat16"
    (row,) = data["rows"]
    assert "skipped" not in row, row
    assert 0 < row["one_device_vs_fp32"] < 3e-2, row  # bf16's own noise, not an O(1) error
    assert row["sp_vs_fp32"] <= 1.5 * row["one_device_vs_fp32"], row
    assert row["max_rel_err"] < 3e-2 and row["rms_rel_err"] < 3e-2 and row["worst_tensor"], row


def test_graphed_rows_do_not_go_with_sp(tmp_path):
    proc = _run(tmp_path, "--world", "2", "--graphed")
    assert proc.returncode == 2 and "--graphed" in proc.stderr

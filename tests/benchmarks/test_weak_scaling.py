"""weak_scaling.py on the CPU (gloo, tiny shapes): 1 and 2 ranks, schema, breakdown, plots."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_dist.config import ConfigError

from .._spawn import subprocess_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scaling_benchmarks" / "weak_scaling.py"
sys.path.insert(0, str(REPO))

from scaling_benchmarks import weak_scaling as ws  # noqa: E402

OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]
HEADER = ("benchmark", "device", "world_size", "torch", "triton", "commit", "date", "switches",
          "config", "rows")
ROW = ("op", "T", "pass", "impl", "ms", "ms_min", "strategy", "world_size", "tokens_per_gpu",
       "breakdown", "peak_mib", "measure", "per_rank", "path")


def _run(tmp_path: Path, world: int) -> dict:
    out = tmp_path / f"w{world}"
    env = dict(os.environ, TRITON_INTERPRET="1", FORGE_DIST_COMMIT="test",
               FORGE_DIST_TIMEOUT="300")  # a switch: recorded with the run
    env = subprocess_env(env)  # the tests' faster interpreter (bitwise Triton's values)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--world", str(world), "--out", str(out),
         "--set", "warmup=1", "--set", "repeats=2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.glob("weak_scaling_*_ws*.json"))
    assert len(files) == 1, (files, proc.stderr[-2000:])
    assert files[0].name.endswith(f"_ws{world}.json")
    assert files[0].with_suffix(".png").stat().st_size > 10_000
    return json.loads(files[0].read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ws2"), 2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ws1"), 1)


def _check_row(r, world):
    for key in ROW:
        assert key in r, f"row lacks {key}: {r}"
    assert r["ms"] > 0 and 0 < r["ms_min"] <= r["ms"]
    assert r["pass"] in ("fwd", "fwdbwd")
    assert r["peak_mib"] is None  # CPU
    assert len(r["per_rank"]) == world
    assert r["path"] in ("plan", "general")


def test_one_rank_writes_ideal_rows(one_rank):
    for key in HEADER:
        assert key in one_rank
    assert one_rank["benchmark"] == "weak_scaling" and one_rank["world_size"] == 1
    assert one_rank["switches"]["FORGE_DIST_TIMEOUT"] == "300"  # the run's switches
    assert "FORGE_DIST_COMMIT" not in one_rank["switches"]  # that is the header's commit
    ideal = [r for r in one_rank["rows"] if r["measure"] == "ideal"]
    assert {(r["op"], r["pass"]) for r in ideal} == {(o, p) for o in OPS
                                                     for p in ("fwd", "fwdbwd")}
    for r in ideal:
        _check_row(r, 1)
        assert r["world_size"] == 1 and r["strategy"] == "ideal" and r["T"] == 256
        b = r["breakdown"]
        assert b["local_ms"] > 0 and b["merge_ms"] > 0 and b["comm_ms"] >= 0


def test_two_ranks_every_strategy_and_breakdown(two_ranks):
    res = two_ranks
    assert res["world_size"] == 2 and res["config"]["backend"] == "gloo"
    ops_rows = [r for r in res["rows"] if r["measure"] == "op"]
    got = {(r["op"], r["pass"], r["strategy"]) for r in ops_rows}
    want = {(o, p, s) for o in OPS for p in ("fwd", "fwdbwd")
            for s in ("serial", "pipelined", "lasp2")}
    assert want <= got, want - got
    for r in ops_rows:
        _check_row(r, 2)
        assert r["world_size"] == 2 and r["T"] == 512 and r["tokens_per_gpu"] == 256
        b = r["breakdown"]
        assert all(b[k] >= 0 for k in ("local_ms", "comm_ms", "merge_ms"))
        assert b["comm_ms"] > 0 and b["local_ms"] > 0
        crit = r["per_rank"][b["rank"]]
        # the components of one repeat add up to that repeat's time
        assert b["local_ms"] + b["comm_ms"] + b["merge_ms"] == pytest.approx(crit["ms"], rel=1e-6)
        assert r["ideal_ms"] > 0 and r["vs_ideal"] == pytest.approx(r["ms"] / r["ideal_ms"])


def test_two_ranks_state_pass_rows(two_ranks):
    sp_rows = [r for r in two_ranks["rows"] if r["measure"] == "state_pass"]
    assert {(r["op"], r["strategy"]) for r in sp_rows} >= {
        (o, s) for o in OPS for s in ("serial", "pipelined", "lasp2")}
    for r in sp_rows:
        assert r["us"] == pytest.approx(r["ms"] * 1e3) and r["us"] > 0
        # B=1, H=2, K=V=16 fp32 states; HGRN [1, 32] (D = H*K)
        want = 32 * 4 / 2 ** 20 if r["op"] == "hgrn" else 2 * 16 * 16 * 4 / 2 ** 20
        assert r["state_mib"] == pytest.approx(want)
    dense = next(r for r in sp_rows if r["op"] == "gated_delta_rule")
    assert dense["transition_mib"] == pytest.approx(2 * 16 * 16 * 4 / 2 ** 20)


def test_unavailable_things_are_skipped_with_reasons(two_ranks):
    skipped = two_ranks["skipped"]
    assert all(s["reason"] for s in skipped)
    # no GPU here: FLA CP cannot run, and says so; forge runs its simulated transport
    # where the suite's interpreter is on, and says why it cannot otherwise
    from forge_dist.sp import forge

    forge_skipped = any(s.get("strategy") == "forge" for s in skipped)
    assert forge_skipped is not forge.interpreted()
    assert any(s["measure"] == "fla_cp" and "CUDA" in s["reason"] for s in skipped)
    assert two_ranks["strategies_available"]["serial"] is True


def test_plot_only_merges_runs(one_rank, two_ranks, tmp_path):
    files = []
    for i, res in enumerate((one_rank, two_ranks)):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(res))
        files.append(str(f))
    png = tmp_path / "sweep.png"
    assert ws.main(["--plot", *files, "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_config_file_and_overrides():
    _, cfg = ws.parse(["--config", str(REPO / "configs" / "weak_scaling_cpu.toml"),
                       "--set", "tokens_per_gpu=128", "--set", "ops=['gla']"])
    assert cfg["cpu"] is True and cfg["K"] == 16 and cfg["tokens_per_gpu"] == 128
    assert cfg["ops"] == ["gla"]
    _, gpu = ws.parse(["--config", str(REPO / "configs" / "weak_scaling.toml")])
    assert (gpu["B"], gpu["H"], gpu["K"], gpu["V"], gpu["tokens_per_gpu"]) == \
        (4, 32, 128, 128, 32768)
    assert gpu["dtype"] == "bfloat16" and gpu["cpu"] is False
    _, cpu = ws.parse(["--cpu", "--set", "B=2"])
    assert (cpu["B"], cpu["H"], cpu["tokens_per_gpu"]) == (2, 2, 256)
    with pytest.raises(ConfigError, match="unknown key"):
        ws.parse(["--set", "tokens=1"])
    with pytest.raises(SystemExit):
        ws.parse(["--set", "ops=['nope']"])


# --- a sweep in pieces: --ops/--strategies/--modes, rows on disk as they finish, merging ----

ENV = subprocess_env(dict(os.environ, TRITON_INTERPRET="1", FORGE_DIST_COMMIT="test"))


def _cmd(out: Path, *extra: str):
    return [sys.executable, str(SCRIPT), "--cpu", "--world", "2", "--out", str(out),
            "--set", "warmup=1", "--set", "repeats=1", "--set", "tokens_per_gpu=64",
            "--tag", "pieces", *extra]


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """A run of simple_gla killed (SIGKILL, as a device call's time limit does) once two rows
    are on disk, then a run of linear_attn with the same tag adding to the same file."""
    import signal
    import time

    out = tmp_path_factory.mktemp("pieces")
    proc = subprocess.Popen(_cmd(out, "--ops", "simple_gla", "--modes", "fwd,fwdbwd",
                                 "--strategies", "serial,lasp2,pipelined"),
                            env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    counts, killed = [], None
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            files = list(out.glob("weak_scaling_*_pieces_ws2.json"))
            data = _read(files[0]) if files else None
            if data is not None:
                counts.append(len(data["rows"]))
                if counts[-1] >= 2:
                    killed = counts[-1]
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and the ranks it spawned
        proc.wait(timeout=30)
    assert killed is not None, f"the run ended ({proc.returncode}) or stalled; rows seen {counts}"
    path = next(out.glob("weak_scaling_*_pieces_ws2.json"))
    first = json.loads(path.read_text())
    second = subprocess.run(_cmd(out, "--ops", "linear_attn", "--modes", "fwd",
                                 "--strategies", "serial,lasp2,auto"),
                            capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(out.glob("weak_scaling_*.json")) == [path]
    return {"path": path, "counts": counts, "first": first, "merged": _read(path)}


def test_killed_run_leaves_its_finished_rows_on_disk(pieces):
    first = pieces["first"]
    assert len(first["rows"]) >= 2  # written as each finished, before the kill
    assert pieces["counts"] == sorted(pieces["counts"])
    assert {r["op"] for r in first["rows"]} == {"simple_gla"}
    assert first["runs"][0]["complete"] is False and first["runs"][0]["ops"] == ["simple_gla"]
    assert first["commit"] == "test" and first["device"] == "cpu" and first["torch"]


def test_ops_strategies_modes_restrict_and_a_second_run_merges(pieces):
    res, first = pieces["merged"], pieces["first"]
    for key in HEADER:
        assert key in res
    # the killed run's rows are all still there, unchanged, under its run index
    for r in first["rows"]:
        assert r in res["rows"] and r["run"] == 0
    mine = [r for r in res["rows"] if r["run"] == 1]
    assert {r["op"] for r in mine} == {"linear_attn"} and {r["pass"] for r in mine} == {"fwd"}
    assert {(r["measure"], r["strategy"]) for r in mine} == {
        ("ideal", "ideal"), ("op", "serial"), ("op", "lasp2"), ("op", "auto"),
        ("state_pass", "serial"), ("state_pass", "lasp2"), ("state_pass", "auto")}
    # an auto row says what auto ran (on the CPU: lasp2)
    assert [r.get("chosen") for r in mine if r["strategy"] == "auto"] == ["lasp2", "lasp2"]
    assert [r["ops"] for r in res["runs"]] == [["simple_gla"], ["linear_attn"]]
    assert res["runs"][1]["complete"] is True and res["runs"][1]["commit"] == "test"
    assert res["config"]["ops"] == ["simple_gla", "linear_attn"]
    assert res["config"]["passes"] == ["fwd", "fwdbwd"]
    assert all(s["reason"] for s in res["skipped"])


def test_phase_breakdown_from_the_library_phase_edges(pieces):
    rows = [r for r in pieces["merged"]["rows"] if r["measure"] in ("op", "ideal")]
    assert any(r["measure"] == "op" for r in rows) and any(r["measure"] == "ideal" for r in rows)
    for r in rows:
        _check_row(r, 2)
        b = r["breakdown"]
        assert b["local_ms"] > 0 and b["merge_ms"] > 0
        if r["measure"] == "op":
            assert b["comm_ms"] > 0
            crit = r["per_rank"][b["rank"]]
            assert b["local_ms"] + b["comm_ms"] + b["merge_ms"] == \
                pytest.approx(crit["ms"], rel=1e-6)
            assert r["vs_ideal"] == pytest.approx(r["ms"] / r["ideal_ms"])
        else:
            assert b["comm_ms"] == 0


def test_plot_of_a_merged_file(pieces, tmp_path):
    png = tmp_path / "merged.png"
    assert ws.main(["--plot", str(pieces["path"]), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_rows_say_which_path_they_timed(one_rank, tmp_path):
    """A row names the path its calls ran: the CPU's default (no kernels) is the general
    path; with the kernels (Triton's interpreter) the ops' calls run on plans.  (A dtype the
    plans refused once sent every hgrn cell down the general path unnoticed.)"""
    assert {r["path"] for r in one_rank["rows"]} == {"general"}
    out = tmp_path / "kernels"
    env = subprocess_env(dict(os.environ, TRITON_INTERPRET="1", FORGE_DIST_KERNELS="triton",
                              FORGE_DIST_COMMIT="test"))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--world", "1", "--out", str(out),
         "--set", "warmup=1", "--set", "repeats=2", "--ops", "simple_gla", "--modes", "fwd"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(out.glob("weak_scaling_*_ws1.json")).read_text())["rows"]
    assert rows and {r["path"] for r in rows} == {"plan"}


def test_cli_options_set_the_config_keys(tmp_path):
    _, cfg = ws.parse(["--cpu", "--ops", "simple_gla,gla", "--strategies", "serial",
                       "--modes", "fwd", "--tag", "x", "--results", str(tmp_path / "r.json")])
    assert cfg["ops"] == ["simple_gla", "gla"] and cfg["strategies"] == ["serial"]
    assert cfg["passes"] == ["fwd"] and cfg["tag"] == "x"
    assert cfg["results"] == str(tmp_path / "r.json")
    _, cfg = ws.parse(["--cpu", "--passes", "fwdbwd", "--set", "ops=['hgrn']"])
    assert cfg["passes"] == ["fwdbwd"] and cfg["ops"] == ["hgrn"]
    for bad in (["--ops", "nope"], ["--strategies", "nope"], ["--modes", "bwd"], ["--ops", ","]):
        with pytest.raises(SystemExit):
            ws.parse(["--cpu", *bad])


def test_merging_refuses_another_shape(tmp_path):
    import torch

    def bench(*extra):
        _, cfg = ws.parse(["--cpu", "--results", str(tmp_path / "r.json"), *extra])
        return ws.Bench(cfg, None, torch.device("cpu"), 0, 2)

    a = bench("--ops", "gla")
    assert a.merge_existing() is None and a.run_index == 0  # no file yet
    a.add_row({"op": "gla", "pass": "fwd", "impl": "forge_dist", "strategy": "serial",
               "measure": "op", "ms": 1.0}, {"op": "gla", "pass": "fwd", "measure": "op",
                                              "strategy": "serial"})
    a.save()
    b = bench("--ops", "hgrn")
    assert b.merge_existing() is None and b.run_index == 1
    assert [r["op"] for r in b.result["rows"]] == ["gla"]
    assert b.result["config"]["ops"] == ["gla", "hgrn"]
    c = bench("--set", "tokens_per_gpu=128")
    reason = c.merge_existing()
    assert reason and "tokens_per_gpu" in reason and "--tag" in reason
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind

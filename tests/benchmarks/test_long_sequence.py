"""long_sequence.py on the CPU (gloo, tiny shapes): a 2-rank sweep, and an OOM on one rank."""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scaling_benchmarks import long_sequence as ls  # noqa: E402

TINY = ["--cpu", "--world", "2", "--set", "hidden_size=32", "--set", "num_heads=2",
        "--set", "head_dim=16", "--lengths", "64", "128"]
HEADER = ("benchmark", "device", "world_size", "torch", "triton", "commit", "date", "config",
          "rows", "max_tokens_trained", "stopped_at")


def _results(out: Path) -> dict:
    files = sorted(out.glob("long_sequence_cpux2_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_COMMIT", "test")
    monkeypatch.delenv("FORGE_DIST_TIMEOUT", raising=False)  # the config's bound applies


def test_two_ranks_train_every_length(tmp_path):
    assert ls.main([*TINY, "--out", str(tmp_path)]) == 0
    data = _results(tmp_path)
    for key in HEADER:
        assert key in data
    assert data["benchmark"] == "long_sequence" and data["world_size"] == 2
    assert data["config"]["strategy"] == "lasp2" and data["config"]["checkpoint"] is False
    assert (data["config"]["H"], data["config"]["K"], data["config"]["V"]) == (2, 16, 16)
    assert [r["T"] for r in data["rows"]] == [64, 128]
    for row in data["rows"]:
        assert row["outcome"] == "ok" and row["error"] is None
        assert row["tokens_per_rank"] == row["T"] // 2
        assert 0 < row["ms_min"] <= row["ms"]
        assert row["tokens_per_s"] == pytest.approx(row["T"] / (row["ms"] / 1e3))
        assert row["peak_gib"] is None  # no CUDA memory statistics on the CPU
        assert [r["rank"] for r in row["per_rank"]] == [0, 1]
        assert all(len(r["ms_repeats"]) == 2 for r in row["per_rank"])
    assert data["max_tokens_trained"] == 128 and data["stopped_at"] is None
    assert (tmp_path / (sorted(tmp_path.glob("*.json"))[0].stem + ".png")).is_file()


def _oom_on_rank_1(rank, world, port, cfg):
    """A spawned rank (picklable target): rank 1 runs out of memory at 128 tokens."""
    real_step = ls.training_step

    def step(layer, x, upstream, checkpoint):
        if rank == 1 and x.shape[1] * world >= 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")
        real_step(layer, x, upstream, checkpoint)

    ls.training_step = step
    ls._spawned(rank, world, port, cfg)


def test_oom_on_one_rank_stops_every_rank(tmp_path):
    """Rank 0 waits in the layer's collective until its bounded wait expires, both ranks
    agree over the control group, the file records the OOM, and nothing hangs."""
    from forge_dist.selftest import free_port

    from .._spawn import start_processes

    _, cfg = ls.parse([*TINY, "--out", str(tmp_path), "--set", "pass_timeout_s=3",
                       "--set", "plot=false"])
    # mp.spawn's processes, started from a server that imported torch once (tests/_spawn.py)
    start_processes(_oom_on_rank_1, args=(2, free_port(), cfg), nprocs=2, join=True)
    data = _results(tmp_path)
    first, second = data["rows"]
    assert first["T"] == 64 and first["outcome"] == "ok"
    assert second["T"] == 128 and second["outcome"] == "oom"
    assert second["error"].startswith("rank 1: OutOfMemoryError")
    assert 1 in second["failed_ranks"] and second["ms"] is None
    assert {r["rank"]: r["outcome"] for r in second["per_rank"]}[1] == "oom"
    assert data["max_tokens_trained"] == 64
    assert data["stopped_at"]["T"] == 128 and data["stopped_at"]["outcome"] == "oom"


def test_lengths_parse_and_must_split_evenly():
    assert [ls.parse_length(t) for t in ("4096", "256K", "4M", "1g")] == \
        [4096, 2 ** 18, 2 ** 22, 2 ** 30]
    with pytest.raises(ValueError, match="length"):
        ls.parse_length("4 million")
    _, cfg = ls.parse(["--lengths", "256K,512K", "1M"])
    assert cfg["lengths"] == [2 ** 18, 2 ** 19, 2 ** 20]
    assert ls.parse([])[1]["lengths"][-1] == 8 * 2 ** 20
    assert ls.check_lengths({"lengths": [64, 96]}, 2) is None
    assert "equal shards" in ls.check_lengths({"lengths": [63]}, 2)

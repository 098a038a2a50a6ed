"""launch/train.py: SP = 2 (and DP = 2) train like SP = 1; checkpoints resume at another SP."""
import copy
import json
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.sp.distributed import run_world

ROOT = Path(__file__).resolve().parents[2]


def _train_module():
    spec = importlib.util.spec_from_file_location("forge_train", ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def small_cfg(out_dir, **over):
    cfg = copy.deepcopy(_train_module().DEFAULTS)
    cfg["model"].update(vocab_size=32, hidden_size=16, num_layers=2, mixer="gdn,gla",
                        num_heads=2)
    cfg["data"].update(seq_len=48, num_kv_pairs=4, batch_size=2, seed=3)
    cfg["train"].update(steps=5, lr=1e-2, warmup_steps=2, log_every=1, ckpt_every=0, seed=5)
    cfg["run"].update(out_dir=str(out_dir), device="cpu")
    for key, value in over.items():
        table, name = key.split(".")
        cfg[table][name] = value
    return cfg


def _run(group, cfg, ref_grads_path):
    """Train in this world; compare the global gradients of every step with SP=1's."""
    ref = torch.load(ref_grads_path) if ref_grads_path else None
    errs = []

    def on_grads(step, grads):
        if ref is not None:
            g = torch.cat([x.reshape(-1) for x in grads]).double()
            errs.append(((g - ref[step]).norm() / ref[step].norm()).item())
    records = _train_module().train(cfg, on_grads=on_grads, echo=False)
    return {"losses": [r["loss"] for r in records], "grad_errs": errs,
            "world": records[0]["world"], "sp": records[0]["sp"], "dp": records[0]["dp"]}


def _single(cfg):
    grads = []

    def on_grads(step, gs):
        grads.append(torch.cat([x.reshape(-1) for x in gs]).double().clone())
    records = _train_module().train(cfg, on_grads=on_grads, echo=False)
    return [r["loss"] for r in records], grads


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_sp2_trains_like_sp1_and_resumes_at_sp1(tmp_path, packed):
    losses1, grads1 = _single(small_cfg(tmp_path / "sp1", **{"data.packed": packed}))
    torch.save(grads1, tmp_path / "grads1.pt")
    cfg2 = small_cfg(tmp_path / "sp2", **{"data.packed": packed, "parallel.sp": 2,
                                          "train.ckpt_every": 3})
    res = run_world(2, _run, cfg2, str(tmp_path / "grads1.pt"))
    assert (res["world"], res["sp"], res["dp"]) == (2, 2, 1)
    assert len(res["losses"]) == 5 and len(res["grad_errs"]) == 5
    assert losses1[-1] < losses1[0]  # it learns something, so the steps are not trivial
    assert _rel(res["losses"], losses1) <= 1e-5
    assert max(res["grad_errs"]) <= 1e-5

    # the SP=2 checkpoint of step 3 continues at SP=1 on the same curve
    resumed, _ = _single(small_cfg(tmp_path / "resume1", **{
        "data.packed": packed, "run.resume": str(tmp_path / "sp2" / "ckpt_3.pt")}))
    assert len(resumed) == 2
    assert _rel(resumed, losses1[3:]) <= 1e-5


def test_sp1_checkpoint_resumes_at_sp2(tmp_path):
    losses1, _ = _single(small_cfg(tmp_path / "sp1", **{"train.ckpt_every": 3}))
    cfg = small_cfg(tmp_path / "sp2", **{"parallel.sp": 2,
                                         "run.resume": str(tmp_path / "sp1" / "ckpt_3.pt")})
    res = run_world(2, _run, cfg, "")
    assert len(res["losses"]) == 2
    assert _rel(res["losses"], losses1[3:]) <= 1e-5
    log = (tmp_path / "sp2" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [4, 5]


def test_dp2_trains_like_sp1(tmp_path):
    losses1, grads1 = _single(small_cfg(tmp_path / "sp1"))
    torch.save(grads1, tmp_path / "grads1.pt")
    res = run_world(2, _run, small_cfg(tmp_path / "dp2", **{"parallel.sp": 1}),
                    str(tmp_path / "grads1.pt"))
    assert (res["sp"], res["dp"]) == (1, 2)
    assert _rel(res["losses"], losses1) <= 1e-5
    assert max(res["grad_errs"]) <= 1e-5


def test_default_config_file_loads():
    from forge_dist import config
    cfg = config.load(_train_module().DEFAULTS, str(ROOT / "configs" / "train_mqar.toml"))
    assert cfg["model"]["mixer"] == "gdn,gla" and cfg["parallel"]["sp"] == 1


def test_a_run_says_what_it_trains_shows_progress_and_draws_its_curves(tmp_path, capsys):
    """What a user sees: a first line naming the model, task and device before the model is
    built, a progress bar with the loss and accuracy, log lines every ``log_every`` steps,
    and the run's curves as a PNG beside its log at the end."""
    cfg = small_cfg(tmp_path / "run", **{"train.steps": 4, "train.log_every": 2})
    _train_module().train(cfg)
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    assert first.startswith("MQAR: 2 layers (gdn,gla) of width 16") and "on cpu" in first, out
    assert "4/4" in err and "loss=" in err and "acc=" in err, err  # tqdm's bar on stderr
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step")] == \
        ["1", "2", "4"], out  # the first step, then every log_every
    png = tmp_path / "run" / "curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out

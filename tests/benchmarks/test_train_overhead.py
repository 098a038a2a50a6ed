"""scaling_benchmarks/train_overhead.py on the CPU: the training call it times runs (the
kernels under Triton's interpreter), a refused op is named, and the plot draws."""
import pytest
import torch

from scaling_benchmarks import results_io, train_overhead


def test_a_training_call_fills_every_gradient(monkeypatch):
    from forge_dist.kernels import interpreting

    if not interpreting():
        pytest.skip("needs the Triton interpreter")
    monkeypatch.setattr(train_overhead, "H", 2)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    inputs = train_overhead.make_inputs("simple_gla", 64, torch.device("cpu"))
    inputs["leaves"] = {n: x.detach().float().requires_grad_(True)
                        for n, x in inputs["leaves"].items()}
    inputs["do"] = inputs["do"].float()
    call = train_overhead.train_call("simple_gla", inputs)
    call()
    assert all(x.grad is not None and torch.isfinite(x.grad).all()
               for x in inputs["leaves"].values())


def test_stacked_layers_chain_the_op_and_reach_every_leaf(monkeypatch):
    """``--layers``: each layer takes the output below as its q; one backward reaches the
    shared k, v, g through every layer (their gradients sum the layers' shares)."""
    from forge_dist.kernels import interpreting

    if not interpreting():
        pytest.skip("needs the Triton interpreter")
    monkeypatch.setattr(train_overhead, "H", 2)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    from forge_dist import ops

    seen = []
    real = ops.simple_gla
    monkeypatch.setattr(ops, "simple_gla", lambda q, *rest: seen.append(q) or real(q, *rest))
    inputs = train_overhead.make_inputs("simple_gla", 64, torch.device("cpu"))
    inputs["leaves"] = {n: x.detach().float().requires_grad_(True)
                        for n, x in inputs["leaves"].items()}
    inputs["do"] = inputs["do"].float()
    train_overhead.train_call("simple_gla", inputs, layers=3)()
    assert len(seen) == 3 and seen[0] is inputs["leaves"]["q"]
    assert all(not q.is_leaf for q in seen[1:])
    one = {n: x.grad.clone() for n, x in inputs["leaves"].items()}
    train_overhead.train_call("simple_gla", inputs, layers=1)()
    assert all(torch.isfinite(g).all() for g in one.values())
    assert not torch.equal(one["k"], inputs["leaves"]["k"].grad)  # three layers' shares


def test_layers_below_one_are_refused():
    with pytest.raises(SystemExit):
        train_overhead.main(["--layers", "0"])


def test_unknown_op_is_named(capsys):
    """Refused before anything else (the GPU check included), with the op and the known ones
    in the message."""
    with pytest.raises(SystemExit) as exc:
        train_overhead.main(["--ops", "simple_gla,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ops: unknown ['nope']" in err and "'gated_delta_rule'" in err


def test_no_gpu_is_said(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert train_overhead.main(["--ops", "simple_gla", "--T", "64"]) == 2
    assert "train_overhead: needs a CUDA GPU" in capsys.readouterr().err


def test_plot_draws_both_paths(tmp_path):
    result = results_io.header("train_overhead", {})
    for op in ("linear_attn", "hgrn"):
        for T in (1024, 2048):
            for path, us in (("general", 1500.0), ("planned", 500.0), ("graphed", 120.0)):
                if path == "graphed" and op == "hgrn":
                    continue  # a run without graphed rows for this op
                result["rows"].append({"op": op, "T": T, "path": path, "us_wall": us,
                                       "us_gpu": 100.0 * T / 1024})
    png = tmp_path / "t.png"
    train_overhead.plot(result, png)
    assert png.stat().st_size > 1000

"""Malformed input to every public entry point: a clear error naming the argument, raised
before any communication or kernel launch, leaving inputs and parameters untouched.

Extends tests/ops/test_bad_input.py (whose cases are not repeated here).  Single-process
cases run with the state pass, the signature all-gather and the op runner replaced by
tripwires, so an error raised after any of them fails the test.  Distributed cases (2 gloo
ranks) check that every rank raises the same error and can still talk afterwards.
"""
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_dist import config, launch_env, nn as fnn, ops
from forge_dist.comm.sim import SimWorld
from forge_dist.ops import attention, checks
from forge_dist.sp import p2p

from ..sp.distributed import run_world

REPO = Path(__file__).resolve().parents[2]
F32, F64 = torch.float32, torch.float64


def _qkv(B=1, T=16, H=2, K=4, V=3, dtype=F32):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, T, H, d, generator=gen).to(dtype) for d in (K, K, V))


def _g(B=1, T=16, H=2):
    return -torch.rand(B, T, H)


q, k, v = _qkv()
g = _g()
gk = -torch.rand(1, 16, 2, 4)
beta = torch.rand(1, 16, 2)
x, gx = torch.randn(1, 16, 6), -torch.rand(1, 16, 6)

# name: (thunk, exception type, words the message must contain)
OPS = {
    "q is a list": (lambda: ops.linear_attn([[1.0]], k, v), TypeError, ["q:", "torch.Tensor"]),
    "v is None": (lambda: ops.linear_attn(q, k, None), TypeError, ["v:", "NoneType"]),
    "k head dim differs": (lambda: ops.linear_attn(q, k[..., :3], v), ValueError,
                           ["k:", "dimension 3"]),
    "v heads differ": (lambda: ops.linear_attn(q, k, v[:, :, :1]), ValueError,
                       ["v:", "dimension 2"]),
    "bool q": (lambda: ops.linear_attn(q > 0, k, v), TypeError, ["q:", "floating"]),
    "complex q": (lambda: ops.linear_attn(q.to(torch.complex64), k, v), TypeError,
                  ["q:", "floating"]),
    "fp16 q with bf16 k": (lambda: ops.linear_attn(q.half(), k.bfloat16(), v.half()),
                           TypeError, ["k:", "float16", "bfloat16"]),
    "v float64 among float32": (lambda: ops.simple_gla(q, k, v.double(), g), TypeError,
                                ["v:", "float64"]),
    "zero heads": (lambda: ops.linear_attn(q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError,
                   ["q:", "empty"]),
    "zero head dim": (lambda: ops.linear_attn(q[..., :0], k[..., :0], v), ValueError,
                      ["q:", "empty"]),
    "zero batch": (lambda: ops.gla(q[:0], k[:0], v[:0], gk[:0]), ValueError,
                   ["q:", "empty"]),
    "empty value dim": (lambda: ops.linear_attn(q, k, v[..., :0]), ValueError,
                        ["v:", "empty"]),
    "gdn g length differs": (lambda: ops.gated_delta_rule(q, k, v, g[:, :5], beta),
                             ValueError, ["g:", "[1, 16, 2]"]),
    "gdn beta 4-D": (lambda: ops.gated_delta_rule(q, k, v, g, beta[..., None]), ValueError,
                     ["beta:", "3 dimensions"]),
    "gdn integer beta": (lambda: ops.gated_delta_rule(q, k, v, g, (beta > 0.5).int()),
                         TypeError, ["beta:", "floating"]),
    "gdn l2norm k shape": (lambda: ops.gated_delta_rule(q, k[:, :8], v, g, beta,
                                                        use_qk_l2norm_in_kernel=True),
                           ValueError, ["k:"]),
    "deltanet beta heads": (lambda: ops.deltanet(q, k, v, beta[:, :, :1]), ValueError,
                            ["beta:"]),
    "gla g last dim": (lambda: ops.gla(q, k, v, gk[..., :2]), ValueError, ["g:", "dimension 3"]),
    "gla integer g": (lambda: ops.gla(q, k, v, gk.long()), TypeError, ["g:", "floating"]),
    "g_gamma 2-D": (lambda: ops.simple_gla(q, k, v, g_gamma=torch.ones(2, 1)), ValueError,
                    ["g_gamma:", "1 dimensions"]),
    "integer g_gamma": (lambda: ops.simple_gla(q, k, v, g_gamma=torch.ones(2, dtype=torch.int32)),
                        TypeError, ["g_gamma:", "floating"]),
    "g_gamma on meta": (lambda: ops.simple_gla(q, k, v, g_gamma=torch.ones(2, device="meta")),
                        ValueError, ["g_gamma:", "meta"]),
    "initial_state list": (lambda: ops.linear_attn(q, k, v, initial_state=[0.0]), TypeError,
                           ["initial_state:", "torch.Tensor"]),
    "integer initial_state": (lambda: ops.linear_attn(
        q, k, v, initial_state=torch.zeros(1, 2, 4, 3, dtype=torch.int64)), TypeError,
        ["initial_state:", "floating"]),
    "initial_state on meta": (lambda: ops.linear_attn(
        q, k, v, initial_state=torch.zeros(1, 2, 4, 3, device="meta")), ValueError,
        ["initial_state:", "meta"]),
    "initial_state transposed K/V": (lambda: ops.linear_attn(
        q, k, v, initial_state=torch.zeros(1, 2, 3, 4)), ValueError,
        ["initial_state:", "[1, 2, 4, 3]"]),
    "scale string": (lambda: ops.linear_attn(q, k, v, scale="0.5"), ValueError, ["scale:"]),
    "scale inf": (lambda: ops.linear_attn(q, k, v, scale=float("inf")), ValueError, ["scale:"]),
    "scale 2-element tensor": (lambda: ops.linear_attn(q, k, v, scale=torch.ones(2)),
                               ValueError, ["scale:", "(2,)"]),
    "scale nan tensor": (lambda: ops.linear_attn(q, k, v, scale=torch.tensor(float("nan"))),
                         ValueError, ["scale:"]),
    "scale True": (lambda: ops.linear_attn(q, k, v, scale=True), ValueError,
                   ["scale:", "boolean", "True"]),
    "scale numpy bool": (lambda: ops.simple_gla(q, k, v, g, scale=np.bool_(False)), ValueError,
                         ["scale:", "boolean", "np.False_"]),
    "scale bool tensor": (lambda: ops.gla(q, k, v, gk, scale=torch.tensor(True)), ValueError,
                          ["scale:", "torch.bool", "tensor(True)"]),
    "scale tensor that requires grad": (lambda: ops.gated_delta_rule(
        q, k, v, g, beta=beta, scale=torch.tensor(0.5, requires_grad=True)), ValueError,
        ["scale:", "requires grad", "tensor(0.5000, requires_grad=True)", "float("]),
    "scale complex": (lambda: ops.linear_attn(q, k, v, scale=0.5 + 1j), ValueError,
                      ["scale:", "(0.5+1j)"]),
    "scale numpy inf": (lambda: ops.linear_attn(q, k, v, scale=np.float32("inf")), ValueError,
                        ["scale:", "np.float32(inf)"]),
    "scale 2-element array": (lambda: ops.linear_attn(q, k, v, scale=np.ones(2)), ValueError,
                              ["scale:", "(2,)"]),
    "cu_seqlens list": (lambda: ops.linear_attn(q, k, v, cu_seqlens=[0, 16]), TypeError,
                        ["cu_seqlens:", "list"]),
    "cu_seqlens 2-D": (lambda: ops.linear_attn(q, k, v, cu_seqlens=torch.tensor([[0, 16]])),
                       ValueError, ["cu_seqlens:", "1-D"]),
    "cu_seqlens one offset": (lambda: ops.linear_attn(q, k, v, cu_seqlens=torch.tensor([0])),
                              ValueError, ["cu_seqlens:", "at least 2"]),
    "cu_seqlens int16": (lambda: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0, 16], dtype=torch.int16)), ValueError,
        ["cu_seqlens:", "int32/int64"]),
    "cu_seqlens on meta": (lambda: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0, 16], device="meta")), ValueError,
        ["cu_seqlens:", "meta"]),
    "cu_seqlens negative": (lambda: ops.linear_attn(q, k, v, cu_seqlens=torch.tensor([-4, 16])),
                            ValueError, ["cu_seqlens:", "start at 0"]),
    "strategy None": (lambda: ops.linear_attn(q, k, v, strategy=None), ValueError,
                      ["strategy:", "None"]),
    "strategy wrong case": (lambda: ops.gla(q, k, v, gk, strategy="LASP2"), ValueError,
                            ["strategy:", "'LASP2'"]),
    "hgrn x 4-D": (lambda: ops.hgrn(x[..., None], gx), ValueError, ["x:", "3 dimensions"]),
    "hgrn integer x": (lambda: ops.hgrn(x.long(), gx), TypeError, ["x:", "floating"]),
    "hgrn initial_state D": (lambda: ops.hgrn(x, gx, initial_state=torch.zeros(1, 5)),
                             ValueError, ["initial_state:", "[1, 6]"]),
    "hgrn g on meta": (lambda: ops.hgrn(x, gx.to("meta")), ValueError, ["g:", "meta"]),
    "hgrn unknown strategy": (lambda: ops.hgrn(x, gx, strategy="ring"), ValueError,
                              ["strategy:", "'ring'"]),
    "retnet q 3-D": (lambda: ops.retnet(q[0], k, v), ValueError, ["q:", "4 dimensions"]),
    "lightning num_layers 0": (lambda: ops.lightning_attn(q, k, v, layer_idx=0, num_layers=0),
                               ValueError, ["num_layers:"]),
    "lightning layer_idx -1": (lambda: ops.lightning_attn(q, k, v, layer_idx=-1, num_layers=4),
                               ValueError, ["layer_idx:"]),
    "mamba2 groups do not divide heads": (lambda: ops.mamba2_ssd(
        torch.randn(1, 16, 3, 4), torch.rand(1, 16, 3), -torch.rand(3), torch.randn(1, 16, 2, 4),
        torch.randn(1, 16, 2, 4)), ValueError, ["B:", "divides H=3"]),
    "mamba2 A shape": (lambda: ops.mamba2_ssd(
        torch.randn(1, 16, 2, 4), torch.rand(1, 16, 2), -torch.rand(4), torch.randn(1, 16, 1, 4),
        torch.randn(1, 16, 1, 4)), ValueError, ["A:", "[2]"]),
    "mamba2 dt shape": (lambda: ops.mamba2_ssd(
        torch.randn(1, 16, 2, 4), torch.rand(1, 8, 2), -torch.rand(2), torch.randn(1, 16, 1, 4),
        torch.randn(1, 16, 1, 4)), ValueError, ["dt:"]),
    "hgrn2 g 3-D": (lambda: ops.hgrn2(q, g, v), ValueError, ["g:", "4 dimensions"]),
}

NN = {
    # all-ones masks (what generate passes) and caches work; padding and caches with
    # packed sequences do not
    "layer attention_mask": (lambda: fnn.LinearAttention(hidden_size=16, num_heads=2)(
        torch.randn(1, 8, 16), attention_mask=torch.tensor([[0] * 2 + [1] * 6])),
        NotImplementedError, ["attention_mask with padding"]),
    "layer use_cache": (lambda: fnn.GatedLinearAttention(hidden_size=16, num_heads=2)(
        torch.randn(1, 8, 16), use_cache=True, cu_seqlens=torch.tensor([0, 3, 8])),
        NotImplementedError, ["use_cache", "cu_seqlens"]),
    "layer unknown feature_map": (lambda: fnn.LinearAttention(hidden_size=16, num_heads=2,
                                                              feature_map="cosine"),
                                  NotImplementedError, ["feature_map:", "'cosine'"]),
    "layer heads do not divide": (lambda: fnn.GatedLinearAttention(hidden_size=16, num_heads=3),
                                  ValueError, ["num_heads=3"]),
    "retention unknown decay": (lambda: fnn.MultiScaleRetention(hidden_size=16, num_heads=2,
                                                                decay="cosine"),
                                ValueError, ["decay:"]),
    "mamba2 unknown activation": (lambda: fnn.Mamba2(num_heads=2, head_dim=16, hidden_size=16,
                                                     hidden_act="gelu"),
                                  NotImplementedError, ["hidden_act:", "gelu"]),
    "conv unknown activation": (lambda: fnn.ShortConvolution(8, 4, activation="relu"),
                                ValueError, ["activation:", "relu"]),
    "halo 2-D input": (lambda: fnn.halo_exchange(torch.randn(8, 4), 3, None), ValueError,
                       ["x:", "[B, T, D]"]),
    "layer group not a group": (lambda: fnn.SimpleGatedLinearAttention(
        hidden_size=16, num_heads=2)(torch.randn(1, 8, 16), group="world"), ValueError,
        ["group:"]),
    "layer unknown strategy": (lambda: fnn.HGRNAttention(hidden_size=16, num_heads=2,
                                                         strategy="ring")(torch.randn(1, 8, 16)),
                               ValueError, ["strategy:", "'ring'"]),
}


def _train_module():
    spec = importlib.util.spec_from_file_location("forge_train", REPO / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(tmp, name, data):
    p = Path(tmp) / name
    p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return str(p)


CFG = {"B": 4, "model": {"layers": 2}}
LAUNCH = {
    "config is a directory": (lambda tmp: config.load(CFG, tmp), config.ConfigError,
                              ["--config:", "no such file"]),
    "config unknown nested key in file": (lambda tmp: config.load(
        CFG, _write(tmp, "a.toml", "[model]\ndepth = 3\n")), config.ConfigError,
        ["unknown key 'depth'"]),
    "config scalar where a table is": (lambda tmp: config.load(
        CFG, _write(tmp, "b.toml", "model = 3\n")), config.ConfigError, ["'model' must be a table"]),
    "config --set empty key path": (lambda tmp: config.load(CFG, None, ["=3"]),
                                    config.ConfigError, ["unknown key ''"]),
    "train --sp does not divide world": (lambda tmp: _train_module().Dist(3, "cpu"), ValueError,
                                         ["--sp:", "sp=3"]),
    "train --sp 0": (lambda tmp: _train_module().Dist(0, "cpu"), ValueError, ["--sp:", "sp=0"]),
    "slurm env not an integer": (lambda tmp: launch_env.detect(
        {"SLURM_PROCID": "zero", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
        use_mpi4py=False), ValueError, ["SLURM_PROCID", "'zero'"]),
    "FORGE_DIST_TIMEOUT not a number": (lambda tmp: _env("FORGE_DIST_TIMEOUT", "soon",
                                                         p2p.timeout_seconds),
                                        ValueError, ["FORGE_DIST_TIMEOUT", "'soon'"]),
    "FORGE_DIST_TIMEOUT zero": (lambda tmp: _env("FORGE_DIST_TIMEOUT", "0", p2p.timeout_seconds),
                                ValueError, ["FORGE_DIST_TIMEOUT", "positive"]),
    "FORGE_DIST_KERNELS unknown": (lambda tmp: _env("FORGE_DIST_KERNELS", "cuda",
                                                    lambda: ops.linear_attn(q, k, v)),
                                   ValueError, ["FORGE_DIST_KERNELS", "'cuda'"]),
    "FORGE_DIST_PIPELINE_TILES not an int": (lambda tmp: _env(
        "FORGE_DIST_PIPELINE_TILES", "four", _pipeline_tiles), ValueError,
        ["FORGE_DIST_PIPELINE_TILES", "'four'"]),
    "FORGE_DIST_PIPELINE_TILES zero": (lambda tmp: _env(
        "FORGE_DIST_PIPELINE_TILES", "0", _pipeline_tiles), ValueError,
        ["FORGE_DIST_PIPELINE_TILES", "positive"]),
    "FORGE_DIST_CHECK_FINITE unknown": (lambda tmp: _env("FORGE_DIST_CHECK_FINITE", "yes",
                                                         checks.check_finite_enabled),
                                        ValueError, ["FORGE_DIST_CHECK_FINITE", "'yes'"]),
    "SimWorld of 0 ranks": (lambda tmp: SimWorld(0), ValueError, ["size must be >= 1"]),
}


def _pipeline_tiles():
    from forge_dist.sp import pipelined

    return pipelined.n_tiles()


def _env(key, value, fn):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(key)
        else:
            os.environ[key] = old


@pytest.fixture
def tripwires(monkeypatch):
    """Fail if a call gets as far as communication or the op runner / kernels."""
    def trip(what):
        def fn(*a, **kw):
            raise AssertionError(f"reached {what} before the argument error")
        return fn
    for name in ("all_gather", "recv", "irecv", "isend"):
        monkeypatch.setattr(p2p, name, trip(f"p2p.{name}"))
    monkeypatch.setattr(attention, "run", trip("the op runner"))
    monkeypatch.setattr(attention, "_work_factory", trip("the kernels"))


def _snapshot(objs):
    return [t.detach().clone() for t in objs if isinstance(t, torch.Tensor)
            and t.device.type != "meta"]


@pytest.mark.parametrize("case", list(OPS) + list(NN))
def test_op_and_layer_bad_input(case, tripwires):
    fn, exc, words = {**OPS, **NN}[case]
    inputs = [q, k, v, g, gk, beta, x, gx]
    before = _snapshot(inputs)
    with pytest.raises(exc) as info:
        fn()
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"
    # Nothing half-written: inputs unchanged, no gradients appeared.
    for a, b in zip(_snapshot(inputs), before):
        assert torch.equal(a, b)
    assert all(t.grad is None for t in inputs)


@pytest.mark.parametrize("scale", [np.float32(0.25), np.float64(0.25), np.int64(1), 1,
                                   torch.tensor(0.25), torch.tensor([0.25], dtype=F64),
                                   np.array(0.25)], ids=repr)
def test_any_real_scalar_scale_is_taken_as_its_value(scale):
    """numpy scalars, ints, 0-d and one-element tensors/arrays give what the float gives."""
    want = ops.simple_gla(q, k, v, g, scale=float(scale))[0]
    assert torch.equal(ops.simple_gla(q, k, v, g, scale=scale)[0], want)


@pytest.mark.parametrize("case", list(LAUNCH))
def test_launcher_and_config_bad_input(case, tmp_path):
    fn, exc, words = LAUNCH[case]
    with pytest.raises(exc) as info:
        fn(str(tmp_path))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_layer_leaves_no_gradients_after_an_error():
    layer = fnn.GatedDeltaNet(hidden_size=16, head_dim=8, num_heads=2, expand_v=1)
    with pytest.raises(ValueError, match="strategy:"):
        layer.strategy = "ring"
        layer(torch.randn(1, 8, 16)).__getitem__(0).sum().backward()
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("argv,words", [
    (["demo", "--world", "65"], "--world"), (["demo", "--ops", "attention"], "--ops"),
    (["demo", "--strategies", "auto"], "--strategies"), (["demo", "--dtypes", "bf16"], "--dtypes")])
def test_cli_rejects_bad_arguments(argv, words, capsys):
    from forge_dist import cli

    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_retnet_non_tensor_q():
    with pytest.raises(TypeError, match="q:"):
        ops.retnet("q", k, v)


def test_config_binary_file(tmp_path):
    with pytest.raises(config.ConfigError):
        config.load(CFG, _write(tmp_path, "bin.toml", b"\xff\xfe\x00B = 1"))


def test_config_type_mismatch():
    with pytest.raises(config.ConfigError):
        config.load(CFG, None, ["B=many"])


# ------------------------------------------------------------------ two gloo ranks
def _two_rank_case(group, what):
    import torch.distributed as dist

    rank = dist.get_rank(group)
    T, H, K = 8, 2, 4
    if what == "heads differ" and rank == 1:
        H = 3
    if what == "head dim differs" and rank == 1:
        K = 6
    qq, kk, vv = _qkv(T=T, H=H, K=K)
    kw = {"group": group}
    try:
        if what == "different ops":
            if rank == 0:
                ops.gla(qq, kk, vv, -torch.rand(1, T, H, K), **kw)
            else:
                ops.hgrn(torch.randn(1, T, 5), -torch.rand(1, T, 5), **kw)
        elif what == "gate given on one rank":
            ops.simple_gla(qq, kk, vv, _g(T=T) if rank == 0 else None, **kw)
        elif what == "requires_grad on one rank":
            ops.linear_attn(qq.requires_grad_(rank == 0), kk, vv, **kw)
        elif what == "local cu_seqlens":  # the offsets of this shard, not the global ones
            ops.linear_attn(qq, kk, vv, cu_seqlens=torch.tensor([0, 3, 8]), **kw)
        elif what == "forge on CPU":
            ops.linear_attn(qq, kk, vv, strategy="forge", **kw)
        elif what == "not a member":
            sub = dist.new_group([0])
            ops.linear_attn(qq, kk, vv, group=sub)
            if rank == 0:
                raise ValueError("group: rank 0 is a member; no error expected")
        else:
            ops.linear_attn(qq, kk, vv, **kw)
        err = None
    except ValueError as e:
        err = str(e)
    dist.barrier(group=group)  # nobody is stuck
    everyone = [None, None]
    dist.all_gather_object(everyone, err, group=group)
    return everyone


@pytest.mark.parametrize("what,ranks,words", [
    ("heads differ", (0, 1), ["H: every rank must pass the same value", "rank 1 has 3"]),
    ("head dim differs", (0, 1), ["K: every rank must pass the same value"]),
    ("different ops", (0, 1), ["every rank must call the same op"]),
    ("gate given on one rank", (0, 1), ["gates given: every rank must pass the same value, "
                                        "but rank 0 has 'g' and rank 1 has 'none'"]),
    ("requires_grad on one rank", (0, 1), ["requires_grad"]),
    ("local cu_seqlens", (0, 1), ["cu_seqlens:", "global length 16"]),
    ("not a member", (1,), ["group: this process is not a member"]),
])
def test_two_ranks_raise_together(what, ranks, words):
    errors = run_world(2, _two_rank_case, what, env={"FORGE_DIST_TIMEOUT": "20"})
    for r in ranks:
        assert errors[r] is not None, errors
        for word in words:
            assert word in errors[r], errors[r]


def test_forge_on_cpu_runs_only_under_the_interpreter_and_says_so():
    """CPU tensors take forge's simulated transport under Triton's interpreter (how the
    suite tests it, tests/sp/test_forge_ops_sim.py); without it the refusal says why."""
    from forge_dist import sp
    from forge_dist.sp import forge

    reason = forge.FORGE.available(torch.device("cpu"))
    if forge.interpreted():
        assert reason is None
    else:
        with pytest.raises(ValueError, match="strategy='forge' cannot run on cpu: .*"
                                             "TRITON_INTERPRET=1"):
            sp.resolve("forge", torch.device("cpu"))


def test_demo_rejects_world_zero(capsys):
    from forge_dist import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--world", "0"])
    assert info.value.code == 2 and "--world" in capsys.readouterr().err

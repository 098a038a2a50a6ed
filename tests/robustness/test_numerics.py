"""Numerical robustness on the CPU path: strong decays (log decay down to -20 per token),
long sequences, all-zero and very large inputs, fp16 inputs; no NaN/Inf where the exact
result is finite.  And the finite-check mode (``FORGE_DIST_CHECK_FINITE=1``), which names
the first non-finite value: stage, tensor, index, rank and global token."""
import math

import pytest
import torch
import torch.nn.functional as F

from forge_dist import ops
from forge_dist.ops.checks import NonFiniteError
from forge_dist.selftest import call_op, call_reference, rel_err

from ._world import spawn

OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]


def _inputs(op, B, T, H, K, V, dtype, gen, g_of):
    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    if op == "hgrn":
        return {"x": rnd(B, T, K), "g": g_of((B, T, K))}
    t = {"q": rnd(B, T, H, K), "k": F.normalize(rnd(B, T, H, K), dim=-1), "v": rnd(B, T, H, V)}
    if op in ("simple_gla", "gated_delta_rule"):
        t["g"] = g_of((B, T, H))
    if op == "gla":
        t["g"] = g_of((B, T, H, K))
    if op == "gated_delta_rule":
        t["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return t


def _run(op, t, **kw):
    return call_op(op, t, output_final_state=True, **kw)


def _ref(op, t):
    return call_reference(op, t, output_final_state=True)


def _forward_backward(op, t, dtype):
    mine = {k: v.to(dtype).requires_grad_() for k, v in t.items()}
    o, s = _run(op, mine)
    (o.float().square().mean() + s.float().square().mean()).backward()
    return o, s, {k: v.grad for k, v in mine.items()}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decay", ["-20", "U(-20,0)", "mixed"])
def test_strong_decays_are_finite_and_accurate(op, decay):
    gen = torch.Generator().manual_seed(1)

    def g_of(shape):
        if decay == "-20":
            return torch.full(shape, -20.0, dtype=torch.float64)
        u = -20 * torch.rand(shape, generator=gen, dtype=torch.float64)
        if decay == "mixed":  # most tokens barely decay, some reset almost completely
            u = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.9,
                            u * 1e-4, u)
        return u
    t = _inputs(op, 1, 150, 2, 8, 8, None, gen, g_of)
    o_ref, s_ref = _ref(op, t)
    o, s, grads = _forward_backward(op, t, torch.float32)
    for name, x in [("o", o), ("final", s)] + list(grads.items()):
        assert torch.isfinite(x).all(), name
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("op", OPS)
def test_all_zero_inputs_give_zero_outputs(op):
    t = _inputs(op, 1, 70, 2, 8, 8, None, torch.Generator().manual_seed(0),
                lambda s: torch.zeros(s, dtype=torch.float64))
    t = {k: torch.zeros_like(v) for k, v in t.items()}
    o, s, grads = _forward_backward(op, t, torch.float32)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(s, torch.zeros_like(s))
    assert all(torch.isfinite(g).all() for g in grads.values())
    if op == "gated_delta_rule":  # zero keys with FLA's in-kernel L2 norm
        z = torch.zeros(1, 8, 2, 4)
        o, _ = ops.gated_delta_rule(z, z, z, None, torch.ones(1, 8, 2),
                                    use_qk_l2norm_in_kernel=True)
        assert torch.equal(o, torch.zeros_like(o))


@pytest.mark.parametrize("op", OPS)
def test_very_large_inputs_fp32(op):
    """Values near 1e12 (products near 1e30 are still finite in fp32)."""
    gen = torch.Generator().manual_seed(2)
    t = _inputs(op, 1, 100, 2, 8, 8, None, gen,
                lambda s: F.logsigmoid(torch.randn(s, generator=gen, dtype=torch.float64)))
    big = {k: (v * 1e12 if k in ("q", "v", "x") else v) for k, v in t.items()}
    if "k" in big and op != "gated_delta_rule":  # the delta rule needs |k| ~ 1 to be stable
        big["k"] = big["k"] * 1e6
    o_ref, s_ref = _ref(op, big)
    assert torch.isfinite(o_ref.float()).all() and torch.isfinite(s_ref.float()).all()
    o, s = _run(op, {k: v.float() for k, v in big.items()})
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("op", OPS)
def test_fp16_inputs_beyond_fp16_intermediates(op):
    """fp16 inputs whose products (k v^T ~ 1e6) overflow fp16 but whose outputs fit: the
    CPU path must compute in fp32 and round only the output."""
    gen = torch.Generator().manual_seed(3)
    t = _inputs(op, 1, 64, 2, 8, 8, None, gen,
                lambda s: F.logsigmoid(torch.randn(s, generator=gen, dtype=torch.float64) + 1))
    t = {k: v.half().double() for k, v in t.items()}
    if op == "hgrn":
        t["x"] = t["x"] * 1000
    else:
        t["v"], t["q"] = t["v"] * 1000, t["q"] / 1000
        if op != "gated_delta_rule":  # the delta rule needs |k| ~ 1 to be stable
            t["k"] = t["k"] * 1000
    t = {k: v.half().double() for k, v in t.items()}  # exactly representable in fp16
    o_ref, s_ref = _ref(op, t)
    assert o_ref.abs().max() < 60000
    o, s = _run(op, {k: v.half() for k, v in t.items()})
    assert o.dtype == torch.float16 and torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 5e-3 and rel_err(s, s_ref) < 1e-4


def _long(op, T, g_scale):
    gen = torch.Generator().manual_seed(4)
    t = _inputs(op, 1, T, 1, 4, 4, None, gen,
                lambda s: g_scale * (1 + torch.rand(s, generator=gen, dtype=torch.float64)))
    o64, s64 = _run(op, t)
    o32, s32 = _run(op, {k: v.float() for k, v in t.items()})
    return o32, s32, o64, s64


@pytest.mark.parametrize("op", OPS)
def test_long_sequence_64k_fp32_matches_fp64(op):
    o32, s32, o64, s64 = _long(op, 1 << 16, -1e-4)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) < 1e-4 and rel_err(s32, s64) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g_scale", [-1e-5, -20.0])
def test_long_sequence_1m_tokens(op, g_scale):
    """2^20 tokens at head size 4 (one process): fp32 against the fp64 run of the same op
    (validated against the token recurrence at small T), and linear_attn against an exact
    fp64 prefix sum."""
    T = 1 << 20
    o32, s32, o64, s64 = _long(op, T, g_scale)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_err(o32, o64) < 1e-4 and rel_err(s32, s64) < 1e-4
    if op == "linear_attn":
        gen = torch.Generator().manual_seed(4)
        t = _inputs(op, 1, T, 1, 4, 4, None, gen, None)
        S = torch.cumsum(t["k"][0, :, 0, :, None] * t["v"][0, :, 0, None, :], dim=0)
        o_exact = 0.5 * torch.einsum("tk,tkv->tv", t["q"][0, :, 0], S)
        assert rel_err(o64[0, :, 0], o_exact) < 1e-10 and rel_err(o32[0, :, 0], o_exact) < 1e-4


# ------------------------------------------------------------------ finite-check mode
def test_finite_check_names_tensor_index_and_rank(monkeypatch):
    q, k, v = (torch.randn(1, 16, 2, 4) for _ in range(3))
    v[0, 9, 1, 2] = float("nan")
    o, _ = ops.linear_attn(q, k, v)  # off by default: NaN propagates silently
    assert torch.isnan(o).any()
    monkeypatch.setenv("FORGE_DIST_CHECK_FINITE", "1")
    with pytest.raises(NonFiniteError, match=r"\(nan\) in input 'v' at index \(0, 9, 1, 2\) "
                                             r"of shape \(1, 16, 2, 4\) on rank 0 \(global "
                                             r"token 9\)"):
        ops.linear_attn(q, k, v)
    # finite inputs whose result overflows fp32: the output is named
    with pytest.raises(NonFiniteError, match=r"\(\+inf\) in output 'o' at index \(0, 0, 0, 0\)"):
        ops.linear_attn(torch.ones(1, 4, 1, 2), torch.full((1, 4, 1, 2), 1e20),
                        torch.full((1, 4, 1, 2), 1e20))
    s0 = torch.zeros(1, 6)
    s0[0, 4] = -math.inf
    with pytest.raises(NonFiniteError, match=r"\(-inf\) in input 'initial_state'"):
        ops.hgrn(torch.randn(1, 8, 6), -torch.rand(1, 8, 6), initial_state=s0)
    ops.linear_attn(q, k, torch.randn(1, 16, 2, 4))  # finite: no error


def _finite_two_ranks(me):
    import os

    os.environ["FORGE_DIST_CHECK_FINITE"] = "1"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=gen) for _ in range(3))
    g = -torch.rand(1, 8, 2, generator=gen)
    if me.rank == 1:
        g[0, 3, 1] = float("inf")
    try:
        ops.simple_gla(q, k, v, g, group=me.group, strategy="serial")
        return None
    except NonFiniteError as err:
        return str(err)


def test_finite_check_raises_on_every_rank():
    res = spawn(2, _finite_two_ranks, deadline_s=60)
    for r in range(2):
        assert res[r] is not None and "(+inf) in input 'g' at index (0, 3, 1) of shape " \
            "(1, 8, 2) on rank 1 (global token 11)" in res[r], res
    assert "reported on rank 0" in res[0]

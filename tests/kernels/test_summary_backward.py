"""The shard summary's backward kernel (forge_dist.kernels.summary_backward) against
autograd through the fp64 summary (``delta``, ``M``) of the PyTorch chunk form, for no,
scalar and per-channel decay, T not a multiple of the chunk, K != V, and steep gates.
Under TRITON_INTERPRET=1 on a CPU machine; the ``gpu`` test runs bf16 at a real shape."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels.summary_backward import (CHUNK, decay_summary_backward,
                                                 decay_summary_backward_triton)
from forge_dist.variants import decay_attention

from .backward_common import DEV, rel, require_kernels

require_kernels()


def inputs(B, T, H, K, V, gate, *, steep=False, seed=0, device=DEV, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    k, v = r(B, T, H, K), r(B, T, H, V)
    g = None
    if gate == "scalar":
        g = torch.nn.functional.logsigmoid(r(B, T, H) + 3)
    elif gate == "vector":
        g = torch.nn.functional.logsigmoid(r(B, T, H, K) + 3)
    if g is not None and steep:
        g = g - 20 * (torch.rand(g.shape, generator=gen, dtype=torch.float64) < 0.05)
    ddelta, dM = r(B, H, K, V), None
    if gate is not None:
        dM = r(B, H) if gate == "scalar" else r(B, H, K)
    cast = lambda t, dt: None if t is None else t.to(device, dt)
    return (cast(k, dtype), cast(v, dtype), cast(g, torch.float32), cast(ddelta, torch.float32),
            cast(dM, torch.float32))


def autograd_reference(k, v, g, ddelta, dM):
    """Gradients of ``<delta, ddelta> + <M, dM>`` through the fp64 chunk-form summary."""
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None
              for t in (k, v, g)]
    q = torch.zeros_like(leaves[0])
    s = decay_attention.summarize(q, leaves[0], leaves[1], leaves[2], 1.0,
                                  need_transition=g is not None)
    loss = (s.delta * ddelta.cpu().double()).sum()
    if g is not None:
        loss = loss + (s.transition.reshape(dM.shape) * dM.cpu().double()).sum()
    wanted = [t for t in leaves if t is not None]
    return torch.autograd.grad(loss, wanted)


@pytest.mark.parametrize("gate", [None, "scalar", "vector"])
@pytest.mark.parametrize("T", [CHUNK - 3, 2 * CHUNK + 5])
def test_summary_backward_matches_autograd(gate, T):
    k, v, g, ddelta, dM = inputs(2, T, 2, 16, 24, gate, seed=T)
    got = decay_summary_backward_triton(k, v, g, ddelta, dM)
    want = autograd_reference(k, v, g, ddelta, dM)
    torch_form = decay_summary_backward(k, v, g, ddelta, dM)
    names = ["dk", "dv", "dg"][:len(want)]
    for name, a, w, t in zip(names, got, want, torch_form):
        assert a.dtype == (g.dtype if name == "dg" else k.dtype)
        assert rel(a, w) < 1e-5, (name, rel(a, w))
        assert rel(a, t) < 1e-5, (name, rel(a, t))
    if gate is None:
        assert got[2] is None


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_summary_backward_steep_gates(gate):
    """Gates of about -20 on some tokens: decays underflow to zero, nothing overflows."""
    k, v, g, ddelta, dM = inputs(1, 3 * CHUNK, 2, 16, 16, gate, steep=True, seed=7)
    got = decay_summary_backward_triton(k, v, g, ddelta, dM)
    want = autograd_reference(k, v, g, ddelta, dM)
    torch_form = decay_summary_backward(k, v, g, ddelta, dM)
    for a, w, t in zip(got, want, torch_form):
        assert torch.isfinite(a).all()
        assert rel(a, w) < 5e-5 and rel(a, w) < 3 * rel(t, w) + 1e-6, (rel(a, w), rel(t, w))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [None, "scalar", "vector"])
def test_summary_backward_bf16_real_shape(gate):
    k, v, g, ddelta, dM = inputs(2, 4096 + 17, 4, 128, 128, gate, device="cuda",
                                 dtype=torch.bfloat16)
    got = decay_summary_backward_triton(k, v, g, ddelta, dM)
    want = decay_summary_backward(k.float(), v.float(), g, ddelta, dM)
    assert (got[2] is None) == (g is None)
    for a, w in zip(got, want):
        if w is not None:
            assert rel(a, w) < 5e-3


def test_summary_backward_compiles_for_hopper(tmp_path):
    """Each gate kind's launch compiles for sm_90 (Triton's compiler and ptxas, no GPU) and
    leaves room for two programs per SM."""
    import json

    from forge_dist.kernels.summary_backward import kernel_specs
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    specs = kernel_specs(128, 128)
    rep = aot.compile_specs(specs, tmp_path / "cache")
    assert sorted(rep["compiled"]) == sorted(s.key for s in specs), rep
    kernels = json.loads((tmp_path / "cache" / "manifest.json").read_text())["kernels"]
    for entry in kernels.values():
        assert 0 < entry["shared"] <= 232448 // 2, entry


@pytest.mark.parametrize("gate", [None, "scalar", "vector"])
def test_summary_backward_bf16_operands(gate):
    """bf16 k, v take the bf16-operand path (ddelta rounded to bf16, fp32 accumulation):
    errors at bf16 rounding against the fp64 autograd reference, at a small shape."""
    from forge_dist.kernels.summary_backward import low_precision_operands

    assert low_precision_operands(torch.bfloat16) and not low_precision_operands(torch.float16)
    k, v, g, ddelta, dM = inputs(1, CHUNK + 9, 2, 32, 32, gate, seed=3, dtype=torch.bfloat16)
    got = decay_summary_backward_triton(k, v, g, ddelta, dM)
    want = autograd_reference(k, v, g, ddelta, dM)
    for a, w in zip(got, want):
        assert a.dtype in (torch.bfloat16, torch.float32)
        assert rel(a, w) < 1e-2, rel(a, w)
    # the fp32-operand path (FORGE_DIST_SUMBWD_LOWP=0) gives other bits: the bf16 one ran
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_DIST_SUMBWD_LOWP", "0")
        exact = decay_summary_backward_triton(k, v, g, ddelta, dM)
    assert not torch.equal(got[0], exact[0])
    assert rel(exact[0], want[0]) < rel(got[0], want[0])
    # and it adds into given bf16 gradients as well
    base = [torch.randn_like(k), torch.randn_like(v), None if g is None else torch.randn_like(g)]
    into = [None if t is None else t.clone() for t in base]
    fused = decay_summary_backward_triton(k, v, g, ddelta, dM, accumulate_into=into)
    for a, b, p in zip(fused, base, got):
        if b is not None:
            assert rel(a, b.float() + p.float()) < 1e-2


@pytest.mark.parametrize("gate", [None, "scalar", "vector"])
def test_summary_backward_accumulates_into_given_gradients(gate):
    """``accumulate_into``: the kernel adds into the finish's gradients in place, giving
    exactly what the separate sum would."""
    k, v, g, ddelta, dM = inputs(1, 2 * CHUNK + 7, 2, 16, 24, gate, seed=11)
    plain = decay_summary_backward_triton(k, v, g, ddelta, dM)
    base = [torch.randn_like(k), torch.randn_like(v),
            None if g is None else torch.randn_like(g)]
    into = [None if t is None else t.clone() for t in base]
    got = decay_summary_backward_triton(k, v, g, ddelta, dM, accumulate_into=into)
    for a, t, p, b in zip(got, into, plain, base):
        if b is None:
            assert a is None
            continue
        assert a is t  # the given tensor, updated in place
        torch.testing.assert_close(a, b + p, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="accumulate_into does not match"):
        decay_summary_backward_triton(k, v, g, ddelta, dM,
                                      accumulate_into=[base[0].double(), base[1], base[2]])


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla"])
@pytest.mark.parametrize("case", ["plain", "q_is_k", "k_used_after", "two_backwards"])
def test_work_backward_fuses_the_summary_gradients_into_the_finish_ones(variant, case,
                                                                         monkeypatch):
    """A work whose summary and finish both reach the loss (what a rank of a sequence-
    parallel call does): the summary's backward adds into the finish's k, v, g gradients
    instead of returning its own, and the input gradients equal the unfused ones, also when
    q is k, when k has a consumer made after the finish (autograd then sums k's gradients
    itself) and when the two parts are backpropagated by separate backward calls (no fusion
    across calls)."""
    from forge_dist import kernels
    from forge_dist.kernels import summary_backward as sb

    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 1, CHUNK + 20, 2, 16, 16
    base = {"q": torch.randn(B, T, H, K, generator=gen), "k": torch.randn(B, T, H, K, generator=gen),
            "v": torch.randn(B, T, H, V, generator=gen), "g": None}
    if variant == "simple_gla":
        base["g"] = -torch.rand(B, T, H, generator=gen) * 0.3
    elif variant == "gla":
        base["g"] = -torch.rand(B, T, H, K, generator=gen) * 0.3
    S_in = torch.randn(B, H, K, V, generator=gen)
    w_o, w_d = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    calls = []
    real = sb.decay_summary_backward_triton

    def spy(*a, accumulate_into=None, **kw):
        calls.append(accumulate_into is not None)
        return real(*a, accumulate_into=accumulate_into, **kw)

    monkeypatch.setattr(sb, "decay_summary_backward_triton", spy)

    def grads(fuse):
        leaves = {n: None if t is None else t.clone().requires_grad_() for n, t in base.items()}
        inputs = dict(leaves)
        if case == "q_is_k":
            inputs["q"] = inputs["k"]
        work = kernels.make_work(variant, inputs, None, variant != "linear_attn")
        delta, M = work.summary(variant != "linear_attn")
        if not fuse:
            work._fuse_grads = False
        o, _ = work.finish(S_in)
        part_o = (o * w_o).sum()
        part_d = (delta * w_d).sum() + (0 if M is None else M.sum())
        if case == "k_used_after":
            part_o = part_o + (inputs["k"] * inputs["k"]).sum()
        if case == "two_backwards":
            part_o.backward()
            part_d.backward()
        else:
            (part_o + part_d).backward()
        return [t.grad for n, t in leaves.items() if t is not None and t.grad is not None]

    fused = grads(True)
    assert calls == [case != "two_backwards"], calls
    plain = grads(False)
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

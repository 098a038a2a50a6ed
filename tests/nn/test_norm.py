"""The RMS norms: the sliced autograd function against the plain fp64 formula (values and
gradients, slices smaller than the input), and what it keeps for the backward."""
import pytest
import torch
import torch.nn.functional as F

from forge_dist.nn import norm
from forge_dist.nn.norm import FusedRMSNormGated, RMSNorm


def plain(x, g, weight, bias, eps, activation):
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    if g is not None:
        y = y * (torch.sigmoid(g) if activation == "sigmoid" else F.silu(g))
    return y


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
@pytest.mark.parametrize("gated,with_bias", [(True, False), (False, False), (False, True)])
def test_rms_norm_matches_plain_formula_in_slices(monkeypatch, activation, gated, with_bias):
    monkeypatch.setattr(norm, "_SLICE_ELEMENTS", 3 * 16)  # 3 rows per slice: 7 slices + rest
    torch.manual_seed(0)
    x = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True) if gated else None
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, requires_grad=True) if with_bias else None
    out = norm._rms_norm(x, g, w, b, 1e-5, activation)
    ref = plain(x, g, w, b, 1e-5, activation)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    inputs = [t for t in (x, g, w, b) if t is not None]
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, upstream)
    want = torch.autograd.grad(ref, inputs, upstream)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(
        lambda *t: norm._rms_norm(t[0], t[1] if gated else None, t[-2 if with_bias else -1],
                                  t[-1] if with_bias else None, 1e-5, activation), tuple(inputs))


def test_modules_keep_bf16_inputs_only():
    """A bf16 activation through the gated norm saves x, g (bf16) and 1/rms per row, no fp32
    copy of the activation (the plain graph keeps five)."""
    x = torch.randn(4, 64, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 64, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    layer = FusedRMSNormGated(32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x, g)
    assert out.dtype == torch.bfloat16
    big_fp32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()]
    assert not big_fp32, [tuple(t.shape) for t in big_fp32]
    out.float().sum().backward()
    assert x.grad is not None and g.grad is not None and layer.weight.grad is not None
    y = RMSNorm(32)(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape

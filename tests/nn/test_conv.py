"""The short convolution's memory contract: what it keeps for the backward.  (Its values
across ranks and packed sequences are checked in test_halo.py.)"""
import torch
import torch.nn.functional as F

from forge_dist.nn import ShortConvolution


def test_conv_keeps_its_input_not_the_window():
    """With gradients the convolution saves its input and halo, not the concatenated window
    or the pre-activation; the recomputed backward equals the direct one."""
    torch.manual_seed(0)
    conv = ShortConvolution(8, 4, bias=True, activation="silu").double()
    x = torch.randn(2, 10, 8, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = conv(x)
    assert all(t.shape[-2:] != (13, 8) and t.shape[-2:] != (8, 13) for t in saved), \
        [tuple(t.shape) for t in saved]
    upstream = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, conv.weight, conv.bias], upstream)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, conv.bias, groups=8))
    want = torch.autograd.grad(ref.transpose(1, 2), [x, conv.weight, conv.bias], upstream)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)

"""GPU: the fused short convolution and gated norm against their PyTorch paths (fp32 and bf16,
values and gradients) at layer-sized shapes, and every layer with the kernels (convolution,
norm, gates, rotary, op) against the same layer on its PyTorch paths."""
import pytest
import torch

from forge_dist.kernels.gated_norm import gated_rms_norm
from forge_dist.kernels.short_conv import short_conv, short_conv_step
from forge_dist import nn as fnn
from forge_dist.nn import norm
from forge_dist.nn.conv import ShortConvolution
from forge_dist.nn.norm import RMSNormGated
from forge_dist.nn.shard import positions

pytestmark = pytest.mark.gpu
# max |a - b| / max |b|: fp32 agrees to rounding; bf16 rounds the output once (2^-8)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a, b):
    # a reference of zeros (e.g. the halo's gradient where a sequence starts at the shard
    # start) must be matched by zeros: 0 / tiny, not 0 / 0
    return ((a.float() - b.float()).abs().max()
            / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed,l2norm", [(False, None), (True, None), (False, 128)])
def test_short_conv_matches_torch(dtype, packed, l2norm):
    torch.manual_seed(0)
    B, T, D = (1 if packed else 2), 4096, 768
    dev = "cuda"
    m = ShortConvolution(D, 4, bias=True).to(dev)
    wide = torch.randn(B, T, D + 64, device=dev, dtype=dtype)
    x = wide[..., 32:32 + D].requires_grad_()
    h = torch.randn(B, 3, D, device=dev, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 100, 2049, T], device=dev) if packed else None
    pos = None if cu is None else positions(T, None, cu, dev)
    got = short_conv(x, m.weight, m.bias, h, pos, "silu", l2norm_head_dim=l2norm)
    xf, hf = x.float(), h.float()
    want = m._local(xf, hf, pos)
    if l2norm:
        heads = want.reshape(B, T, D // l2norm, l2norm)
        want = (heads / torch.sqrt((heads * heads).sum(-1, keepdim=True) + 1e-6)).reshape(B, T, D)
    assert rel(got, want) < TOL[dtype]
    up = torch.randn(B, T, D, device=dev)
    inputs = [x, m.weight, m.bias, h]
    g_got = torch.autograd.grad(got.float(), inputs, up)
    g_want = torch.autograd.grad(want, inputs, up)
    for a, b in zip(g_got, g_want):
        assert rel(a, b) < 5 * TOL[dtype]


def test_short_conv_step_matches_full_conv():
    torch.manual_seed(1)
    m = ShortConvolution(1536, 4, bias=True).cuda()
    x = torch.randn(4, 8, 1536, device="cuda")
    want = short_conv(x, m.weight, m.bias)
    cache = torch.zeros(4, 1536, 4, device="cuda")
    got = torch.stack([short_conv_step(x[:, t], cache, m.weight, m.bias) for t in range(8)], 1)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_gated_norm_matches_torch(dtype, activation):
    torch.manual_seed(2)
    N, D = 2 * 8192 * 6, 256
    x = torch.randn(N, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(N, D, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True)
    got = gated_rms_norm(x, g, w, None, 1e-5, activation)
    want = norm._RMSNormFn.apply(x, g, w, None, 1e-5, activation)
    assert rel(got, want) < TOL[dtype]
    up = torch.randn(N, D, device="cuda", dtype=dtype)
    for a, b in zip(torch.autograd.grad(got, [x, g, w], up),
                    torch.autograd.grad(want, [x, g, w], up)):
        assert rel(a, b) < 5 * TOL[dtype]


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_mamba2_norm_matches_torch(monkeypatch, norm_before_gate):
    torch.manual_seed(3)
    m = RMSNormGated(2048, group_size=1024, norm_before_gate=norm_before_gate).cuda()
    x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = m(x, z)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = m(x, z)
    assert rel(got, want) < 1e-2
    up = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [x, z, m.weight], up),
                    torch.autograd.grad(want, [x, z, m.weight], up)):
        assert rel(a, b) < 2e-2


LAYERS = {
    "gdn": lambda: fnn.GatedDeltaNet(hidden_size=256, head_dim=64, num_heads=2),
    "gla": lambda: fnn.GatedLinearAttention(hidden_size=256, num_heads=2, use_short_conv=True),
    "hgrn": lambda: fnn.HGRNAttention(hidden_size=256),
    "retnet": lambda: fnn.MultiScaleRetention(hidden_size=256, num_heads=2),
    "simple_gla": lambda: fnn.SimpleGatedLinearAttention(hidden_size=256, num_heads=2),
    "mamba2": lambda: fnn.Mamba2(hidden_size=256, head_dim=64, state_size=64),
    "linear_attn": lambda: fnn.LinearAttention(hidden_size=256, num_heads=2),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_kernels_match_torch_path(monkeypatch, name):
    """The layer on CUDA (fused convolution with q/k normalisation, norm, gates, rotary, the
    op's kernels) equals the same layer on the PyTorch paths (fp32), output and gradients."""
    torch.manual_seed(4)
    layer = LAYERS[name]().cuda()
    x = torch.randn(2, 1024, 256, device="cuda", requires_grad=True)
    params = [x] + list(layer.parameters())
    got = layer(x)[0]
    g_got = torch.autograd.grad(got.sum(), params)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = layer(x)[0]
    g_want = torch.autograd.grad(want.sum(), params)
    assert rel(got, want) < 2e-3  # the op's kernels use TF32 dots against PyTorch's fp32
    for a, b in zip(g_got, g_want):
        assert rel(a, b) < 1e-2


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_repeated_calls_relaunch_what_the_first_compiled(monkeypatch, name):
    """Later calls relaunch the layer's kernels kept by the first (kernels.jit_launch
    .KeptLaunches): on new inputs, one of them not 16-byte aligned, with and without autograd,
    they give bitwise what Triton's own launches give."""
    torch.manual_seed(5)
    layer = LAYERS[name]().cuda().to(torch.bfloat16)
    buf = torch.randn(2 * 1024 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    inputs = [torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    inputs.append(buf[1:].view(2, 1024, 256))  # 2 bytes off: the JIT's unaligned kernels

    def run(x):
        with torch.no_grad():
            y = layer(x)[0]
        x = x.detach().requires_grad_()
        params = [x] + list(layer.parameters())
        out = layer(x)[0]
        return [y, out] + list(torch.autograd.grad(out.float().square().sum(), params))

    kept = [run(x) for x in inputs + inputs[:1]]
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "0")
    for x, got in zip(inputs + inputs[:1], kept):
        for a, b in zip(got, run(x)):
            assert torch.equal(a, b)

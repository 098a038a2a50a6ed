"""The layers' fused Triton kernels (run by the interpreter on the CPU) against their PyTorch
paths, values and gradients in fp64: the short convolution (halo, packed sequences, strided
inputs, the fused q/k normalisation, decoding steps), every norm mode the layers use, the gate
activations (GLA, HGRN, GatedDeltaNet) and the rotary embedding."""
import os

import pytest
import torch
import torch.nn.functional as F

from forge_dist.kernels.gated_norm import gated_rms_norm
from forge_dist.kernels.short_conv import short_conv, short_conv_step
from forge_dist.nn import norm
from forge_dist.nn.conv import ShortConvolution
from forge_dist.nn.norm import FusedRMSNormGated, RMSNormGated
from forge_dist.nn.shard import positions

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # a GPU machine: see the _gpu file
    pytest.skip("runs the kernels on CPU tensors in Triton's interpreter (TRITON_INTERPRET "
                "unset); test_fused_conv_norm_gpu.py checks them on the GPU",
                allow_module_level=True)

F64 = torch.float64


def _grads(out, inputs, upstream):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], upstream)


def _ran(out, name):
    """Whether the autograd graph of ``out`` passes through a node called ``name``."""
    todo, seen = [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn.name().endswith(name):
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _assert_same(got, want):
    """fp64 agreement up to summation order, relative to each gradient's largest entry."""
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10 * max(1.0, e.abs().max()))


@pytest.mark.parametrize("K,bias,act,halo,packed", [
    (4, True, "silu", True, True), (4, False, "silu", False, False),
    (3, True, None, True, False), (2, False, "silu", False, True)])
def test_short_conv_matches_torch_path(K, bias, act, halo, packed):
    """The kernel with a halo tensor and per-token positions equals the module's PyTorch
    convolution of the same shard (``_local``: concatenated halo, masked taps), forward and
    backward, on a strided input (a split of a wider projection)."""
    torch.manual_seed(0)
    B, T, D = (1 if packed else 2), 70, 20  # two token tiles plus a partial one
    m = ShortConvolution(D, K, bias=bias, activation=act).double()
    with torch.no_grad():
        m.weight.normal_()
    wide = torch.randn(B, T, D + 7, dtype=F64)
    x = wide[:, :, 3:3 + D].requires_grad_()  # token stride D + 7
    h = torch.randn(B, K - 1, D, dtype=F64, requires_grad=True) if halo else None
    cu = torch.tensor([0, 2, 33, 34, 70]) if packed else None
    # as a middle rank would see it: positions continue from the previous shard
    pos = None
    if packed:
        pos = positions(T, None, cu, x.device)
        pos[:2] += 5  # the first packed sequence began two shards back: its taps reach the halo
    got = short_conv(x, m.weight, m.bias, h, pos, act)
    want = m._local(x, h if halo else x.new_zeros(B, K - 1, D), pos)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(want)
    inputs = [x, m.weight, m.bias, h]
    _assert_same(_grads(got, inputs, up), _grads(want, inputs, up))


@pytest.mark.parametrize("act", ["silu", None])
def test_short_conv_fused_l2norm(act):
    """``l2norm_head_dim`` normalises every head after the activation as FLA's GatedDeltaNet
    does, ``y / sqrt(|y|^2 + 1e-6)``: an all-zero head stays zero, and a head with
    ``|y|^2`` near the epsilon is scaled by about 1/sqrt(2) (``y / max(|y|, eps)``, the form
    used before, made it a unit vector)."""
    torch.manual_seed(1)
    B, T, D, hd = 2, 40, 64, 32
    m = ShortConvolution(D, 4, activation=act).double()
    x = torch.randn(B, T, D, dtype=F64)
    x[0, :, :hd] = 0  # batch 0, head 0: zero input, zero output (silu(0) = 0)
    x[1, :, hd:] *= 1e-4  # batch 1, head 1: |y|^2 of the order of the epsilon
    x.requires_grad_()
    h = torch.randn(B, 3, D, dtype=F64)
    h[0, :, :hd] = 0
    h.requires_grad_()
    got = short_conv(x, m.weight, None, h, None, act, l2norm_head_dim=hd)
    y = m._local(x, h, None).reshape(B, T, D // hd, hd)
    want = (y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6)).reshape(B, T, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    small = got.detach().reshape(B, T, D // hd, hd)[1, 3:, 1].norm(dim=-1)  # past the halo
    assert small.max() < 0.9, small.max()  # not unit vectors
    up = torch.randn_like(want)
    _assert_same(_grads(got, [x, m.weight, h], up), _grads(want, [x, m.weight, h], up))


def test_short_conv_rejects_wide_kernels_and_bad_head_dims():
    x = torch.randn(1, 4, 8, dtype=F64)
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(8, 1, 5, dtype=F64))
    with pytest.raises(ValueError, match="l2norm_head_dim"):
        short_conv(x, torch.randn(8, 1, 4, dtype=F64), l2norm_head_dim=12)


def test_module_dispatches_to_kernels(monkeypatch):
    """``FORGE_DIST_KERNELS=triton`` under the interpreter runs the kernels from the module;
    with a packed batch the result equals the PyTorch module path."""
    torch.manual_seed(2)
    m = ShortConvolution(16, 4, bias=True).double()
    x = torch.randn(1, 24, 16, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, 5, 24])
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = m(x, cu_seqlens=cu, l2norm_head_dim=16)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    assert m._fused(x, 16)
    got = m(x, cu_seqlens=cu, l2norm_head_dim=16)
    assert _ran(got, "ShortConvFnBackward")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_decode_steps_continue_the_convolution(monkeypatch, kernels):
    """Token-by-token ``step`` from a zero cache gives the full convolution's outputs and
    leaves FLA's cache (the last K inputs) behind."""
    monkeypatch.setenv("FORGE_DIST_KERNELS", kernels)
    torch.manual_seed(3)
    m = ShortConvolution(12, 4, bias=True)
    x = torch.randn(2, 6, 12)
    with torch.no_grad():
        want = m._local(x, x.new_zeros(2, 3, 12), None)
        cache = torch.zeros(2, 12, 4)
        got = torch.stack([m.step(x[:, t], cache) for t in range(6)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, x[:, 2:].transpose(1, 2))
    with pytest.raises(ValueError, match="cache"):
        m.step(x[:, 0], torch.zeros(2, 12, 3))


@pytest.mark.parametrize("gated,activation,affine,with_bias", [
    (True, "swish", True, False), (True, "sigmoid", True, True), (False, "swish", True, True),
    (True, "swish", False, False)])
def test_gated_norm_matches_sliced_function(gated, activation, affine, with_bias):
    """The fused norm equals :class:`forge_dist.nn.norm._RMSNormFn` (values and gradients of
    x, gate, weight, bias) on a strided input."""
    torch.manual_seed(4)
    N, D = 37, 24
    x = torch.randn(N, D + 3, dtype=F64)[:, 1:D + 1].requires_grad_()
    g = torch.randn(N, D, dtype=F64, requires_grad=True) if gated else None
    w = torch.randn(D, dtype=F64, requires_grad=True) if affine else None
    b = torch.randn(D, dtype=F64, requires_grad=True) if with_bias else None
    got = gated_rms_norm(x, g, w, b, 1e-5, activation)
    want = norm._RMSNormFn.apply(x, g, w, b, 1e-5, activation)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(want)
    _assert_same(_grads(got, [x, g, w, b], up), _grads(want, [x, g, w, b], up))


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_norm_matches_mamba2_group_norm(monkeypatch, norm_before_gate):
    """Mamba2's grouped norm (gate before or after) through the module: kernels against the
    PyTorch formula."""
    torch.manual_seed(5)
    m = RMSNormGated(32, group_size=16, norm_before_gate=norm_before_gate).double()
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 5, 32, dtype=F64, requires_grad=True)
    z = torch.randn(2, 5, 32, dtype=F64, requires_grad=True)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = m(x, z)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    got = m(x, z)
    assert _ran(got, "GatedRMSNormFnBackward")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(want)
    _assert_same(_grads(got, [x, z, m.weight], up), _grads(want, [x, z, m.weight], up))


def test_gated_norm_saves_inputs_and_rstd(monkeypatch):
    """The fused norm keeps x, g, weight and 1/rms (fp32, one per row) for the backward."""
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    layer = FusedRMSNormGated(32)
    x = torch.randn(4, 8, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 8, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x, g)
    shapes = sorted((tuple(t.shape), t.dtype) for t in saved)
    assert shapes == sorted([((64, 32), torch.bfloat16), ((64, 32), torch.bfloat16),
                             ((32,), torch.float32), ((64, 1), torch.float32)]), shapes


@pytest.mark.parametrize("clamp_min", [None, -0.5])
def test_logsigmoid_gate_matches_torch(clamp_min):
    """GLA's gate ``max(logsigmoid(x) / 16, clamp_min)`` from one kernel, on a strided input."""
    from forge_dist.kernels.gates import logsigmoid_gate

    torch.manual_seed(6)
    x = (10 * torch.randn(3, 7, 40, dtype=F64))[..., :33].requires_grad_()
    got = logsigmoid_gate(x, 16, clamp_min)
    want = F.logsigmoid(x) / 16
    if clamp_min is not None:
        want = torch.clamp_min(want, clamp_min)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(want)
    _assert_same(_grads(got, [x], up), _grads(want, [x], up))


@pytest.mark.parametrize("bounded", [False, True])
def test_hgrn_gates_match_torch(bounded):
    """HGRN's ``(silu(i) (1 - exp(g)), g)`` from one kernel, ``g = logsigmoid(f)`` or, with a
    lower bound, ``logaddexp(log lb, log1p(-lb) + logsigmoid(f))``; every gradient."""
    from forge_dist.kernels.gates import hgrn_gates

    torch.manual_seed(7)
    i = torch.randn(2, 9, 20, dtype=F64, requires_grad=True)
    f = (5 * torch.randn(2, 9, 20, dtype=F64)).requires_grad_()
    lb = (0.05 + 0.9 * torch.rand(20, dtype=F64)).requires_grad_() if bounded else None
    x, g = hgrn_gates(i, f, lb)
    g_want = F.logsigmoid(f)
    if bounded:
        g_want = torch.logaddexp(lb.log(), torch.log1p(-lb) + g_want)
    x_want = F.silu(i) * (1 - g_want.exp())
    torch.testing.assert_close(x, x_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)
    u1, u2 = torch.randn_like(x), torch.randn_like(g)
    inputs = [i, f] + ([lb] if bounded else [])
    _assert_same(torch.autograd.grad((x * u1).sum() + (g * u2).sum(), inputs),
                 torch.autograd.grad((x_want * u1).sum() + (g_want * u2).sum(), inputs))


@pytest.mark.parametrize("D", [16, 20])
def test_rotary_kernel_matches_torch(monkeypatch, D):
    """The fused rotary (16 of D channels rotated, a strided input) equals the PyTorch formula,
    values and gradient."""
    from forge_dist.nn.rotary import RotaryEmbedding

    torch.manual_seed(8)
    rot = RotaryEmbedding(16).double()
    x = torch.randn(2, 37, 3, D + 4, dtype=F64)[..., 2:2 + D].requires_grad_()
    pos = torch.arange(37) + 1000
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = rot.rotate(x, pos)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    got = rot.rotate(x, pos)
    assert _ran(got, "_RotaryBackward")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(want)
    _assert_same(_grads(got, [x], up), _grads(want, [x], up))


@pytest.mark.parametrize("with_pos", [True, False])
def test_rotary_of_q_and_k_in_one_kernel_matches_torch(monkeypatch, with_pos):
    """q and k (other head counts, strided) rotated in one launch, at positions given or
    from ``pos0``, equal the PyTorch formula per tensor; gradients of both, also where only
    q's output is used."""
    from forge_dist.nn.rotary import RotaryEmbedding

    torch.manual_seed(10)
    rot = RotaryEmbedding(16).double()
    q = torch.randn(2, 37, 3, 24, dtype=F64)[..., 2:22].requires_grad_()
    k = torch.randn(2, 37, 2, 20, dtype=F64).transpose(0, 1).contiguous().transpose(0, 1)
    k.requires_grad_()
    pos = torch.arange(37) + 1000
    call = (pos,) if with_pos else (None, 1000)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    want = rot(q, k, *call)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    got = rot(q, k, *call)
    assert _ran(got[0], "_RotaryBackward") and _ran(got[1], "_RotaryBackward")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    up = [torch.randn_like(w) for w in want]
    _assert_same(torch.autograd.grad(got, [q, k], up, retain_graph=True),
                 torch.autograd.grad(want, [q, k], up, retain_graph=True))
    dq, dk = torch.autograd.grad((got[0] * up[0]).sum(), [q, k], allow_unused=True)
    (dq_want,) = torch.autograd.grad((want[0] * up[0]).sum(), [q])
    _assert_same([dq], [dq_want])
    assert dk is None or not dk.any()  # k's output unused: no gradient (PyTorch: None)


def test_rotary_of_k_alone_and_forward_ad(monkeypatch):
    """Only k differentiated: its gradient equals PyTorch's and q gets none; forward-mode AD
    still goes through the autograd function (which refuses it) rather than drop a tangent."""
    import torch.autograd.forward_ad as fwAD
    from forge_dist.nn.rotary import RotaryEmbedding

    torch.manual_seed(11)
    rot = RotaryEmbedding(16).double()
    q, k = torch.randn(1, 9, 2, 16, dtype=F64), torch.randn(1, 9, 1, 16, dtype=F64)
    k.requires_grad_()
    up = torch.randn(1, 9, 1, 16, dtype=F64)
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    (want,) = torch.autograd.grad((rot(q, k, None, 7)[1] * up).sum(), [k])
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    q_out, k_out = rot(q, k, None, 7)
    assert not q_out.requires_grad
    (got,) = torch.autograd.grad((k_out * up).sum(), [k])
    _assert_same([got], [want])
    with fwAD.dual_level(), pytest.raises(RuntimeError):
        rot(fwAD.make_dual(q, torch.ones_like(q)), k.detach(), None, 7)


def test_retention_decays_cached_under_inference_mode_still_train(monkeypatch):
    """RetNet's decays kept per device are not the inference-mode tensor of an earlier
    ``torch.inference_mode()`` call when the layer trains afterwards (B = T = 1: the op
    would save them as they are)."""
    from forge_dist import nn as fnn

    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    torch.manual_seed(12)
    layer = fnn.MultiScaleRetention(hidden_size=64, num_heads=2)
    with torch.inference_mode():
        layer(torch.randn(1, 1, 64))
    x = torch.randn(1, 1, 64, requires_grad=True)
    layer(x)[0].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_decode_step_normalises_heads_like_forward():
    """``step(..., l2norm_head_dim)`` gives the last token of the normalised forward."""
    torch.manual_seed(9)
    m = ShortConvolution(32, 4)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = m(x, l2norm_head_dim=16)[:, -1]
        cache = torch.zeros(2, 32, 4)
        for t in range(5):
            got = m.step(x[:, t], cache, l2norm_head_dim=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_gdn_gates_match_torch(beta_scale):
    """GatedDeltaNet's g and beta from one kernel; gradients of a, b, A_log and dt_bias."""
    from forge_dist.kernels.gates import gdn_gates

    torch.manual_seed(10)
    a, b = (torch.randn(2, 7, 6, dtype=F64, requires_grad=True) for _ in range(2))
    A_log, dt_bias = (torch.randn(6, dtype=F64, requires_grad=True) for _ in range(2))
    g, beta = gdn_gates(a, b, A_log, dt_bias, beta_scale)
    g_want = -A_log.exp() * F.softplus(a + dt_bias)
    beta_want = beta_scale * torch.sigmoid(b)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(beta, beta_want, rtol=1e-12, atol=1e-12)
    u1, u2 = torch.randn_like(g), torch.randn_like(beta)
    inputs = [a, b, A_log, dt_bias]
    _assert_same(torch.autograd.grad((g * u1).sum() + (beta * u2).sum(), inputs),
                 torch.autograd.grad((g_want * u1).sum() + (beta_want * u2).sum(), inputs))


def test_hgrn_layer_with_lower_bound_kernels_match_torch(monkeypatch):
    """HGRN at ``layer_idx > 0`` with FLA's lower bound: the layer with the fused gates (and
    kernels throughout) equals its PyTorch path, output and the lower bound's gradient."""
    from forge_dist.nn import HGRNAttention

    torch.manual_seed(11)
    layer = HGRNAttention(hidden_size=16, layer_idx=1).double()
    x = torch.randn(1, 12, 16, dtype=F64)
    lb = (0.1 + 0.8 * torch.rand(16, dtype=F64)).requires_grad_()
    out = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("FORGE_DIST_KERNELS", kernels)
        o = layer(x, lower_bound=lb)[0]
        out[kernels] = (o, torch.autograd.grad(o.sum(), lb)[0])
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-10, atol=1e-10)

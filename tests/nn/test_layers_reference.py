"""Every layer at SP = 1 against a plain fp64 computation written from the model's equations.

The references below use the layer's parameters but none of its code: projections with
``F.linear``, the short convolution with ``F.conv1d`` run separately on every packed document,
rotary from its formula, and the recurrences from :mod:`forge_dist.variants.reference`
(token-by-token loops).  Outputs and parameter gradients are compared, batched and packed.
"""
import pytest
import torch
import torch.nn.functional as F

from forge_dist.variants import reference as ref

from .helpers import FACTORIES, make_layer, rel_err

T = 20
CU = torch.tensor([0, 3, 11, 20])


def docs(cu, T_):
    """``(start, end)`` of every document (one spanning everything when unpacked)."""
    if cu is None:
        return [(0, T_)]
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def conv(x, m, cu, act=True):
    """Depthwise causal conv per document with F.conv1d (padding K-1, keep the first L)."""
    K = m.weight.shape[-1]
    outs = []
    for a, b in docs(cu, x.shape[1]):
        y = F.conv1d(x[:, a:b].transpose(1, 2), m.weight, m.bias, padding=K - 1,
                     groups=x.shape[-1])[..., :b - a].transpose(1, 2)
        outs.append(F.silu(y) if act else y)
    return torch.cat(outs, 1)


def rms(x, w, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def heads(x, d):
    return x.reshape(*x.shape[:-1], -1, d)


def flat(x):
    return x.reshape(*x.shape[:-2], -1)


def rotary(x, pos, dim):
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ang = pos.double()[:, None] * inv.double()[None]
    c, s = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:dim]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., dim:]], -1)


def positions(cu, T_):
    pos = torch.arange(T_)
    if cu is not None:
        for a, b in docs(cu, T_):
            pos[a:b] -= a
    return pos


def gated_out(m, o, x, norm):
    g = heads(F.linear(x, m.g_proj.weight), o.shape[-1])
    return F.linear(flat(rms(o, norm.weight) * F.silu(g)), m.o_proj.weight)


def reference(name, m, x, cu):
    kw = dict(cu_seqlens=cu)
    if name == "linear_attn":
        dk = m.head_k_dim
        q, k, v = (heads(F.linear(x, p.weight), dk) for p in (m.q_proj, m.k_proj, m.v_proj))
        fq, fk = m.feature_map_q, m.feature_map_k
        q = F.linear(q, fq.layer1.weight, fq.layer1.bias) * F.linear(q, fq.layer2.weight,
                                                                     fq.layer2.bias)
        k = F.linear(k, fk.layer1.weight, fk.layer1.bias) * F.linear(k, fk.layer2.weight,
                                                                     fk.layer2.bias)
        o, _ = ref.linear_attn_ref(q, k, v, **kw)
        return F.linear(flat(rms(o, m.norm.weight)), m.o_proj.weight)
    if name in ("retnet", "lightning"):
        q, k, v = (F.linear(x, p.weight) for p in (m.q_proj, m.k_proj, m.v_proj))
        if name == "retnet":
            q, k, v = conv(q, m.q_conv1d, cu), conv(k, m.k_conv1d, cu), conv(v, m.v_conv1d, cu)
        q, k, v = heads(q, m.head_k_dim), heads(k, m.head_k_dim), heads(v, m.head_v_dim)
        if name == "retnet":
            pos = positions(cu, x.shape[1])
            q, k = rotary(q, pos, m.head_k_dim), rotary(k, pos, m.head_k_dim)
            gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(2, dtype=torch.float64)))
            gamma = gamma.float().double()  # the layer's decays are fp32 constants
        else:
            q, k = F.silu(q), F.silu(k)
            slopes = 2.0 ** (-8.0 * torch.arange(1, 3, dtype=torch.float64) / 2)
            gamma = (-slopes * (1 - 1 / 2 + 1e-5)).float().double()  # layer 1 of 3
        o, _ = ref.simple_gla_ref(q, k, v, g_gamma=gamma, **kw)
        return gated_out(m, o, x, m.g_norm_swish_gate)
    if name == "simple_gla":
        q, k, v = (conv(F.linear(x, p.weight), c, cu) for p, c in
                   ((m.q_proj, m.q_conv1d), (m.k_proj, m.k_conv1d), (m.v_proj, m.v_conv1d)))
        q, k, v = heads(q, m.head_k_dim), heads(k, m.head_k_dim), heads(v, m.head_v_dim)
        g = F.logsigmoid(F.linear(x, m.gk_proj.weight, m.gk_proj.bias)) / 16
        o, _ = ref.simple_gla_ref(q, k, v, g=g, **kw)
        return gated_out(m, o, x, m.g_norm_swish_gate)
    if name == "gla":
        q, k, v = (conv(F.linear(x, p.weight), c, cu) for p, c in
                   ((m.q_proj, m.q_conv1d), (m.k_proj, m.k_conv1d), (m.v_proj, m.v_conv1d)))
        gk = F.linear(F.linear(x, m.gk_proj[0].weight), m.gk_proj[1].weight, m.gk_proj[1].bias)
        d = m.head_k_dim
        # one kv head shared by both query heads (num_kv_heads=1)
        q = heads(q, d)
        k, gk = heads(k, d).expand(-1, -1, 2, -1), heads(gk, d).expand(-1, -1, 2, -1)
        v = heads(v, m.head_v_dim).expand(-1, -1, 2, -1)
        o, _ = ref.gla_ref(q, k, v, F.logsigmoid(gk) / 16, **kw)
        return gated_out(m, o, x, m.g_norm_swish_gate)
    if name == "hgrn":
        i = conv(F.linear(x, m.i_proj.weight), m.i_conv1d, cu, act=False)
        f = F.logsigmoid(conv(F.linear(x, m.f_proj.weight), m.f_conv1d, cu, act=False))
        o, _ = ref.hgrn_ref(F.silu(i) * (1 - f.exp()), f, **kw)
        g = F.linear(x, m.g_proj.weight)
        return F.linear(rms(o, m.g_norm.weight) * F.silu(g), m.o_proj.weight)
    if name == "gdn":
        q, k, v = (conv(F.linear(x, p.weight), c, cu) for p, c in
                   ((m.q_proj, m.q_conv1d), (m.k_proj, m.k_conv1d), (m.v_proj, m.v_conv1d)))
        # 2 q/k heads, 4 value heads: value head j reads q/k head j // 2
        q = heads(q, 4).repeat_interleave(2, dim=2)
        k = heads(k, 4).repeat_interleave(2, dim=2)
        v = heads(v, 6)
        beta = torch.sigmoid(F.linear(x, m.b_proj.weight))
        g = -m.A_log.exp() * F.softplus(F.linear(x, m.a_proj.weight) + m.dt_bias)
        o, _ = ref.gated_delta_rule_ref(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
        return gated_out(m, o, x, m.o_norm)
    if name == "mamba2":
        I, H, P, G, N = 32, 4, 8, 2, 4
        zxbcdt = F.linear(x, m.in_proj.weight)
        z, xBC, dt = zxbcdt.split([I, I + 2 * G * N, H], -1)
        xBC = conv(xBC, m.conv1d, cu)
        xs, Bm, Cm = xBC.split([I, G * N, G * N], -1)
        dt = F.softplus(dt + m.dt_bias)
        A = -m.A_log.exp()
        xs = heads(xs, P)
        k = heads(Bm, N).repeat_interleave(H // G, 2)
        q = heads(Cm, N).repeat_interleave(H // G, 2)
        y, _ = ref.simple_gla_ref(q, k, xs * dt[..., None], g=A * dt, scale=1.0, **kw)
        y = flat(y + m.D[:, None] * xs)
        yz = heads(y * F.silu(z), I // G)  # grouped RMSNorm over n_groups groups
        y = flat(yz / torch.sqrt(yz.pow(2).mean(-1, keepdim=True) + 1e-5)) * m.norm.weight
        return F.linear(y, m.out_proj.weight)
    raise KeyError(name)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_layer_matches_reference_fp64(name, packed):
    m = make_layer(name, torch.float64)
    gen = torch.Generator().manual_seed(3)
    B = 1 if packed else 2
    cu = CU if packed else None
    x = torch.randn(B, T, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(B, T, 16, generator=gen, dtype=torch.float64)

    o_ref = reference(name, m, x, cu)
    (o_ref * w).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)

    o = m(x, cu_seqlens=cu)[0]
    (o * w).sum().backward()
    assert rel_err(o, o_ref) <= 1e-10
    for n, p in m.named_parameters():
        assert p.grad is not None and g_ref[n] is not None, n
        assert rel_err(p.grad, g_ref[n]) <= 1e-10, n


def test_packed_documents_do_not_see_each_other():
    """A document's output depends only on its own tokens (conv, rotary, state all reset)."""
    for name in FACTORIES:
        m = make_layer(name, torch.float64)
        x = torch.randn(1, T, 16, dtype=torch.float64)
        packed = m(x, cu_seqlens=CU)[0]
        alone = torch.cat([m(x[:, a:b])[0] for a, b in docs(CU, T)], 1)
        assert rel_err(packed, alone) <= 1e-12, name

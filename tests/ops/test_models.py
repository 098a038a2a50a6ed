"""Named model wrappers against references written with the same parameterisation."""
import torch
import torch.nn.functional as F

from forge_dist import ops
from forge_dist.selftest import rel_err
from forge_dist.variants import reference as ref

gen = torch.Generator().manual_seed(7)


def r(*s):
    return torch.randn(*s, generator=gen, dtype=torch.float64)


def test_retnet_decays_are_retnets():
    gamma = ops.retnet_decays(4).double()
    expected = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(4)], dtype=torch.float64)
    assert torch.allclose(gamma.exp(), expected, rtol=1e-6)


def test_retnet_and_lightning():
    q, k, v = r(2, 40, 4, 6), r(2, 40, 4, 6), r(2, 40, 4, 5)
    o, _ = ops.retnet(q, k, v)
    o_r, _ = ref.simple_gla_ref(q, k, v, g_gamma=ops.retnet_decays(4).double())
    assert rel_err(o, o_r) <= 1e-6  # the decays are fp32
    o, _ = ops.lightning_attn(q, k, v, layer_idx=1, num_layers=4)
    slopes = torch.exp2(-8.0 * torch.arange(1, 5, dtype=torch.float64) / 4)
    gamma = (-slopes * (1 - 1 / 3 + 1e-5)).float().double()
    o_r, _ = ref.simple_gla_ref(q, k, v, g_gamma=gamma)
    assert rel_err(o, o_r) <= 1e-10


def test_mamba2_ssd_matches_its_recurrence():
    b, T, H, P, G, N = 2, 30, 4, 3, 2, 5
    x, dt = r(b, T, H, P), F.softplus(r(b, T, H))
    A, Bm, Cm, D = -torch.rand(H, generator=gen, dtype=torch.float64), r(b, T, G, N), \
        r(b, T, G, N), r(H)
    y, S = ops.mamba2_ssd(x, dt, A, Bm, Cm, D, output_final_state=True)
    # Token recurrence of SSD: h_t = exp(A dt_t) h_{t-1} + B_t (x_t dt_t)^T, y_t = C_t^T h_t + D x_t
    h = torch.zeros(b, H, N, P, dtype=torch.float64)
    ys = []
    Bh, Ch = Bm.repeat_interleave(H // G, 2), Cm.repeat_interleave(H // G, 2)
    for t in range(T):
        h = (A * dt[:, t]).exp()[..., None, None] * h + \
            Bh[:, t, :, :, None] * (x[:, t] * dt[:, t, :, None])[:, :, None, :]
        ys.append(torch.einsum("bhn,bhnp->bhp", Ch[:, t], h) + D[:, None] * x[:, t])
    assert rel_err(y, torch.stack(ys, 1)) <= 1e-10
    assert rel_err(S, h) <= 1e-10


def test_hgrn2_and_deltanet():
    q, v = r(1, 25, 2, 4), r(1, 25, 2, 3)
    g = F.logsigmoid(r(1, 25, 2, 4))
    o, _ = ops.hgrn2(q, g, v)
    o_r, _ = ref.gla_ref(q, 1 - g.exp(), v, g)
    assert rel_err(o, o_r) <= 1e-10
    k = r(1, 25, 2, 4)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(r(1, 25, 2))
    o, _ = ops.deltanet(q, k, v, beta)
    o_r, _ = ref.gated_delta_rule_ref(q, k, v, None, beta)
    assert rel_err(o, o_r) <= 1e-10

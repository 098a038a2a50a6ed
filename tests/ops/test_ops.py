"""Single-process ops against the fp64 recurrences: shapes, options, dtypes, wrappers."""
import pytest
import torch
import torch.nn.functional as F

from forge_dist import ops
from forge_dist.selftest import rel_err
from forge_dist.variants import reference as ref


def _inputs(B, T, H, K, V, dtype=torch.float64, seed=0, strong=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    shift = -3.0 if strong else 2.0
    g = F.logsigmoid(r(B, T, H) + shift)
    gk = F.logsigmoid(r(B, T, H, K) + shift)
    if strong:  # decays down to -20 per token
        g = g.clamp_min(-20.0) * 4
        gk = gk.clamp_min(-20.0) * 4
    beta = torch.sigmoid(r(B, T, H))
    S0 = r(B, H, K, V)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return tuple(map(cast, (q, k, v, g, gk, beta, S0)))


SHAPES = [  # (B, T, H, K, V): K != V, head dims that are no power of two, ragged T
    (2, 37, 2, 8, 8),
    (1, 130, 3, 5, 7),
    (2, 64, 1, 12, 4),
]


def _check(out, expected, tol):
    o, S = out
    o_r, S_r = expected
    assert o.dtype == o_r.dtype or o.dtype != torch.float64
    assert rel_err(o, o_r) <= tol, rel_err(o, o_r)
    if S_r is not None:
        assert S is not None and S.dtype in (torch.float32, torch.float64)
        assert rel_err(S, S_r) <= tol, rel_err(S, S_r)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_state", [False, True])
def test_linear_attn_simple_gla_gla(shape, with_state):
    q, k, v, g, gk, _, S0 = _inputs(*shape)
    init = S0 if with_state else None
    kw = dict(initial_state=init, output_final_state=True)
    _check(ops.linear_attn(q, k, v, **kw), ref.linear_attn_ref(q, k, v, **kw), 1e-10)
    _check(ops.simple_gla(q, k, v, g, **kw), ref.simple_gla_ref(q, k, v, g=g, **kw), 1e-10)
    _check(ops.gla(q, k, v, gk, **kw), ref.gla_ref(q, k, v, gk, **kw), 1e-10)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gdn", "deltanet"])
def test_gated_delta_rule(shape, gated):
    q, k, v, g, _, beta, S0 = _inputs(*shape)
    k = k / k.norm(dim=-1, keepdim=True)
    g = g if gated else None
    kw = dict(initial_state=S0, output_final_state=True)
    _check(ops.gated_delta_rule(q, k, v, g, beta, **kw),
           ref.gated_delta_rule_ref(q, k, v, g, beta, **kw), 1e-10)


def test_gated_delta_rule_l2norm_flag():
    q, k, v, g, _, beta, S0 = _inputs(2, 40, 2, 6, 5)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    _check(ops.gated_delta_rule(q, k, v, g, beta, **kw),
           ref.gated_delta_rule_ref(q, k, v, g, beta, **kw), 1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_l2norm_flag_is_flas_form_for_small_keys(dtype):
    """``use_qk_l2norm_in_kernel`` normalises as FLA's kernels do, ``x / sqrt(|x|^2 + 1e-6)``
    (FLA's l2norm and fused_recurrent): where ``|k|^2`` is of the order of the epsilon, as
    in a freshly initialised GatedDeltaNet, ``x / max(|x|, 1e-6)`` gave other outputs."""
    q, k, v, g, _, beta, _ = _inputs(1, 24, 2, 8, 4)
    q, k = q * 1e-3, k * 1e-3  # |x|^2 about 8e-6
    qf = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kf = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    want = ref.gated_delta_rule_ref(qf, kf, v, g, beta)[0]
    unit = ref.gated_delta_rule_ref(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta)[0]
    assert rel_err(unit, want) > 0.05  # the two forms differ here
    got = ops.gated_delta_rule(*(t.to(dtype) for t in (q, k, v, g, beta)),
                               use_qk_l2norm_in_kernel=True)[0]
    assert rel_err(got.double(), want) < (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("T", [1, 17, 300])
def test_hgrn(T):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 10, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(2, T, 10, generator=gen, dtype=torch.float64))
    h0 = torch.randn(2, 10, generator=gen, dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True)
    _check(ops.hgrn(x, g, **kw), ref.hgrn_ref(x, g, **kw), 1e-10)


def test_final_state_none_unless_asked():
    q, k, v, g, gk, beta, _ = _inputs(1, 20, 2, 4, 4)
    assert ops.simple_gla(q, k, v, g)[1] is None
    assert ops.gla(q, k, v, gk)[1] is None
    assert ops.gated_delta_rule(q, k, v, g, beta)[1] is None
    assert ops.hgrn(q[..., 0, :], g[..., :1].expand(1, 20, 4))[1] is None


def test_scale_and_g_gamma():
    q, k, v, g, _, _, S0 = _inputs(2, 33, 3, 4, 6)
    gamma = torch.tensor([-0.1, -0.5, -2.0], dtype=torch.float64)
    kw = dict(initial_state=S0, output_final_state=True, scale=0.37)
    _check(ops.simple_gla(q, k, v, g_gamma=gamma, **kw),
           ref.simple_gla_ref(q, k, v, g_gamma=gamma, **kw), 1e-10)
    _check(ops.simple_gla(q, k, v, g, g_gamma=gamma, **kw),
           ref.simple_gla_ref(q, k, v, g=g, g_gamma=gamma, **kw), 1e-10)


def test_strong_decays_stay_finite():
    q, k, v, g, gk, beta, S0 = _inputs(1, 200, 2, 8, 8, strong=True)
    assert g.min() < -15 and gk.min() < -15
    kw = dict(initial_state=S0, output_final_state=True)
    for out, exp in [
        (ops.simple_gla(q, k, v, g, **kw), ref.simple_gla_ref(q, k, v, g=g, **kw)),
        (ops.gla(q, k, v, gk, **kw), ref.gla_ref(q, k, v, gk, **kw)),
        (ops.gated_delta_rule(q, k / k.norm(dim=-1, keepdim=True), v, g, beta, **kw),
         ref.gated_delta_rule_ref(q, k / k.norm(dim=-1, keepdim=True), v, g, beta, **kw)),
    ]:
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
        _check(out, exp, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q, k, v, g, gk, _, S0 = _inputs(1, 70, 2, 8, 8)
    lo = [t.to(dtype) for t in (q, k, v)]
    o, S = ops.gla(*lo, gk.float(), initial_state=S0.float(), output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    o_r, S_r = ref.gla_ref(*[t.double() for t in lo], gk, initial_state=S0,
                           output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= 1e-5


@pytest.mark.parametrize("op", ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"])
def test_varlen_single_rank(op):
    from forge_dist.selftest import run_case

    for dtype in (torch.float64, torch.float32):
        res = run_case(op, "serial", dtype, True, T_local=50)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        assert res.max_error <= tol, res.errors


def test_gradients_fp64():
    """Autograd through the chunk form equals autograd through the recurrence."""
    q, k, v, g, gk, beta, S0 = _inputs(1, 45, 2, 5, 3)
    k = k / k.norm(dim=-1, keepdim=True)
    args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o, S = ops.gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True)
    (o.square().sum() + S.sum()).backward()
    ref_args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o_r, S_r = ref.gated_delta_rule_ref(*ref_args[:5], initial_state=ref_args[5],
                                        output_final_state=True)
    (o_r.square().sum() + S_r.sum()).backward()
    for a, b in zip(args, ref_args):
        assert rel_err(a.grad, b.grad) <= 1e-10

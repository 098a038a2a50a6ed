"""Numerical robustness of the Triton kernels on a GPU (the CPU path: test_numerics.py).

Strong decays (log decay -20 per token, U(-20, 0), mostly-flat with sudden resets), all-zero
inputs, very large fp32 inputs, fp16 inputs whose products overflow fp16, and 2^20 tokens:
no NaN or Inf where the exact result is finite, outputs and final states close to an fp64
reference (the token recurrence on the GPU, or an exact prefix sum at 2^20 tokens)."""
import pytest
import torch
import torch.nn.functional as F

from forge_dist.selftest import call_op, call_reference, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]
DEV = "cuda"


def _inputs(op, T, g_of, B=1, H=2, K=64, V=64, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=DEV, dtype=torch.float64)
    if op == "hgrn":
        return {"x": rnd(B, T, 128), "g": g_of((B, T, 128), gen)}
    t = {"q": rnd(B, T, H, K), "k": F.normalize(rnd(B, T, H, K), dim=-1), "v": rnd(B, T, H, V)}
    if op in ("simple_gla", "gated_delta_rule"):
        t["g"] = g_of((B, T, H), gen)
    if op == "gla":
        t["g"] = g_of((B, T, H, K), gen)
    if op == "gated_delta_rule":
        t["beta"] = torch.rand(B, T, H, generator=gen, device=DEV, dtype=torch.float64)
    return t


def _cast(t, dtype):
    """q/k/v/x in ``dtype``; gates and beta in fp32 (as the layers pass them)."""
    return {k: v.to(dtype if k in ("q", "k", "v", "x") else torch.float32)
            for k, v in t.items()}


def _run(op, t, **kw):
    return call_op(op, t, output_final_state=True, **kw)


def _decay(kind):
    def g_of(shape, gen):
        if kind == "-20":
            return torch.full(shape, -20.0, device=DEV, dtype=torch.float64)
        u = -20 * torch.rand(shape, generator=gen, device=DEV, dtype=torch.float64)
        if kind == "mixed":  # most tokens barely decay, some reset almost completely
            u = torch.where(torch.rand(shape, generator=gen, device=DEV,
                                       dtype=torch.float64) < 0.9, u * 1e-4, u)
        return u
    return g_of


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decay", ["-20", "U(-20,0)", "mixed"])
def test_strong_decays_bf16_forward_backward(op, decay):
    t = _inputs(op, 1000, _decay(decay))
    o_ref, s_ref = call_reference(op, t, output_final_state=True)
    mine = {k: v.requires_grad_() for k, v in _cast(t, torch.bfloat16).items()}
    o, s = _run(op, mine)
    (o.float().square().mean() + s.float().square().mean()).backward()
    for name, x in [("o", o), ("final", s)] + [(k, v.grad) for k, v in mine.items()]:
        assert torch.isfinite(x).all(), name
    assert rel_err(o, o_ref) < 2e-2 and rel_err(s, s_ref) < 2e-2


@pytest.mark.parametrize("op", OPS)
def test_all_zero_inputs_give_zero_outputs(op):
    t = {k: torch.zeros_like(v) for k, v in
         _inputs(op, 300, lambda s, g: torch.zeros(s, device=DEV, dtype=torch.float64)).items()}
    mine = {k: v.requires_grad_() for k, v in _cast(t, torch.bfloat16).items()}
    o, s = _run(op, mine)
    (o.float().square().mean() + s.float().square().mean()).backward()
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(s, torch.zeros_like(s))
    assert all(torch.isfinite(v.grad).all() for v in mine.values())


@pytest.mark.parametrize("op", OPS)
def test_very_large_inputs_fp32(op):
    """q, v (x) near 1e12 and keys near 1e6: products near 1e30 are still finite in fp32."""
    t = _inputs(op, 300, lambda s, g: F.logsigmoid(
        torch.randn(s, generator=g, device=DEV, dtype=torch.float64)))
    big = {k: (v * 1e12 if k in ("q", "v", "x") else v) for k, v in t.items()}
    if "k" in big and op != "gated_delta_rule":  # the delta rule needs |k| ~ 1 to be stable
        big["k"] = big["k"] * 1e6
    o_ref, s_ref = call_reference(op, big, output_final_state=True)
    o, s = _run(op, {k: v.float() for k, v in big.items()})
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 5e-3 and rel_err(s, s_ref) < 5e-3


@pytest.mark.parametrize("op", OPS)
def test_fp16_inputs_beyond_fp16_intermediates(op):
    """fp16 inputs whose products (k v^T ~ 1e6 per token) overflow fp16 while the outputs
    fit: states and intermediates must not be rounded to fp16."""
    t = _inputs(op, 256, lambda s, g: F.logsigmoid(
        torch.randn(s, generator=g, device=DEV, dtype=torch.float64) + 1))
    if op == "hgrn":
        t["x"] = t["x"] * 1000
    else:
        t["v"], t["q"] = t["v"] * 1000, t["q"] / 1000
        if op != "gated_delta_rule":
            t["k"] = t["k"] * 1000
    t = {k: v.half().double() for k, v in t.items()}  # exactly representable in fp16
    o_ref, s_ref = call_reference(op, t, output_final_state=True)
    assert o_ref.abs().max() < 60000
    o, s = _run(op, _cast(t, torch.float16))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 5e-3 and rel_err(s, s_ref) < 5e-3


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g_scale", [-1e-5, -20.0])
def test_a_million_tokens_bf16(op, g_scale):
    """2^20 tokens: finite, and bf16 inputs close to the same inputs in fp32."""
    t = _inputs(op, 1 << 20, lambda s, g: g_scale * (1 + torch.rand(
        s, generator=g, device=DEV, dtype=torch.float64)), H=1, K=64, V=64)
    t = {k: v.float() for k, v in t.items()}
    o32, s32 = _run(op, t)
    o16, s16 = _run(op, _cast(t, torch.bfloat16))
    for x in (o32, s32, o16, s16):
        assert torch.isfinite(x).all()
    assert rel_err(o16, o32) < 2e-2 and rel_err(s16, s32) < 2e-2


def test_a_million_tokens_linear_attention_against_an_exact_prefix_sum():
    T, K = 1 << 20, 16
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, k, v = (torch.randn(1, T, 1, K, generator=gen, device=DEV, dtype=torch.float64)
               for _ in range(3))
    k = F.normalize(k, dim=-1)
    S = torch.cumsum(k[0, :, 0, :, None] * v[0, :, 0, None, :], dim=0)
    o_exact = K ** -0.5 * torch.einsum("tk,tkv->tv", q[0, :, 0], S)
    del S
    o, s = call_op("linear_attn", {"q": q.float(), "k": k.float(), "v": v.float()},
                   output_final_state=True)
    assert torch.isfinite(o).all()
    assert rel_err(o[0, :, 0], o_exact) < 1e-2


def _with_resets(op, T, seed=0):
    """Gates ``logsigmoid(N(2, 1))`` with hard resets (``-inf``) at the first and last token
    of chunks of 16, 32 and 64 tokens, back to back, over a whole 64-token chunk and (gla)
    at 5 % of the other (token, channel) pairs."""
    t = _inputs(op, T, lambda s, g: F.logsigmoid(
        torch.randn(s, generator=g, device=DEV, dtype=torch.float64) + 2.0), seed=seed)
    g = t["g"]
    for start in range(0, T, 256):
        for off in (15, 16, 31, 32, 63, 64, 127, 128):
            if start + off < T:
                g[:, start + off] = float("-inf")
    g[:, 192:256] = float("-inf")
    g[:, T - 1] = float("-inf")
    if op == "gla":
        gen = torch.Generator(device=DEV).manual_seed(seed + 7)
        more = torch.rand(g.shape, generator=gen, device=DEV, dtype=torch.float64) < 0.05
        t["g"] = g.masked_fill(more, float("-inf"))
    t["initial_state"] = torch.randn(
        (1, 128) if op == "hgrn" else (1, 2, 64, 64), device=DEV, dtype=torch.float64)
    return t


@pytest.mark.parametrize("op", ["simple_gla", "gla", "gated_delta_rule", "hgrn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hard_resets_forward_backward(op, dtype):
    """``g = -inf`` (tests/robustness/test_numerics_resets.py on the CPU): the kernels give
    finite outputs, final states and gradients (q, k, v, g, beta, initial state); in fp32
    all of them equal the fp64 recurrence's to the kernel path's fp32 tolerance
    (tests/ops/test_ops_gpu.py), in bf16 the outputs and final state to bf16's."""
    t = _with_resets(op, 1000)
    gen = torch.Generator(device=DEV).manual_seed(1)
    master = {k: v.clone().requires_grad_() for k, v in t.items()}
    o_ref, s_ref = call_reference(op, master, output_final_state=True)
    w_o = torch.randn(o_ref.shape, generator=gen, device=DEV, dtype=torch.float64)
    w_s = torch.randn(s_ref.shape, generator=gen, device=DEV, dtype=torch.float64)
    ((o_ref * w_o).sum() + (s_ref * w_s).sum()).backward()
    mine = {k: v.requires_grad_() for k, v in _cast(t, dtype).items()}
    o, s = _run(op, mine)
    ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
    pairs = [("o", o, o_ref), ("final", s, s_ref)] + [
        ("d" + k, v.grad, master[k].grad) for k, v in mine.items()]
    for name, x, want in pairs:
        assert torch.isfinite(x).all(), name
    checked = pairs if dtype == torch.float32 else pairs[:2]
    tol = 3e-3 if dtype == torch.float32 else 2e-2
    errors = {name: rel_err(x, want) for name, x, want in checked}
    assert max(errors.values()) <= tol, errors

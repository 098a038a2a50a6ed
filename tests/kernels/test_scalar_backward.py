"""Triton backward of the scalar-decay matrix state (forge_dist.kernels.scalar_backward).

Gradients of ``<o, do> + <S_T, dht>`` against torch.autograd through the fp64 token
recurrence (forge_dist.variants.reference.simple_gla_ref; ``g=None`` is linear_attn).  On a
CPU machine the kernels run under TRITON_INTERPRET=1 (conftest.py) at tiny shapes; the
``gpu`` test runs bf16 at a real shape against fp32 autograd of the PyTorch chunk form.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels.scalar_backward import scalar_decay_backward
from forge_dist.variants.reference import simple_gla_ref

from .backward_common import DEV, rel, require_kernels

require_kernels()


def make(B, T, H, K, V, *, gate, s_in, dht, steep=False, seed=0, device=DEV,
         dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    x = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V), "g": None, "S_in": None,
         "do": r(B, T, H, V), "dht": None}
    if gate:
        x["g"] = torch.nn.functional.logsigmoid(r(B, T, H) + 2)
        if steep:  # about -20 to -34 per token
            x["g"] = x["g"] * 20 - 20
    if s_in:
        x["S_in"] = r(B, H, K, V)
    if dht:
        x["dht"] = r(B, H, K, V)
    out = {}
    for n, t in x.items():
        if t is not None:
            t = t.to(device, dtype if n in ("q", "k", "v") else torch.float32)
        out[n] = t
    return out


def fp64_grads(x, scale):
    """Autograd of the fp64 token recurrence: (dq, dk, dv, dg, dS_in)."""
    names = ("q", "k", "v", "g", "S_in")
    leaves = {n: (None if x[n] is None else x[n].detach().double().cpu().requires_grad_(True))
              for n in names}
    o, ST = simple_gla_ref(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], scale=scale,
                           initial_state=leaves["S_in"], output_final_state=True)
    loss = (o * x["do"].double().cpu()).sum()
    if x["dht"] is not None:
        loss = loss + (ST * x["dht"].double().cpu()).sum()
    loss.backward()
    return [None if leaves[n] is None else leaves[n].grad for n in names]


def check(x, scale, tol=1e-4, **kw):
    got = scalar_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"],
                                scale, **kw)
    want = fp64_grads(x, scale)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS_in"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= tol, (name, rel(a, b))
    return got


CASES = [  # (T, K, V, gate, S_in, dht)
    (1, 16, 32, True, True, True),
    (37, 32, 16, True, True, True),
    (64, 32, 32, True, False, True),
    (130, 16, 32, True, True, False),
    (130, 32, 16, False, True, True),
    (37, 16, 16, False, False, False),
    (64, 32, 32, False, False, True),
    (1, 32, 16, False, True, False),
]


@pytest.mark.parametrize("T,K,V,gate,s_in,dht", CASES,
                         ids=[f"T{c[0]}-K{c[1]}-V{c[2]}-{'g' if c[3] else 'nog'}"
                              f"{'-S' if c[4] else ''}{'-dht' if c[5] else ''}" for c in CASES])
def test_matches_fp64_autograd(T, K, V, gate, s_in, dht):
    x = make(1, T, 2, K, V, gate=gate, s_in=s_in, dht=dht, seed=T + K)
    dq, dk, dv, dg, dS = check(x, K ** -0.5)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    assert (dg is None) == (not gate) and (dS is None) == (not s_in)
    if gate:
        assert dg.dtype == torch.float32 and dg.shape == (1, T, 2)


def test_steep_gates():
    """Gates of -20..-34 per token: every exponent a non-positive difference, and dg from the
    straddling-pair form (no q.dq - k.dk cancellation of O(1) diagonal terms)."""
    x = make(1, 130, 2, 32, 32, gate=True, s_in=True, dht=True, steep=True, seed=3)
    check(x, 0.3)


def test_several_tiles_and_batches():
    """Non-power-of-2 K, V split into several tiles in every kernel, B=2, T not a multiple of
    BT: separate dv kernel with dg summed over K tiles, then dv fused into the dq/dk kernel
    (one K tile) over several V tiles."""
    small = {"walk_BK": 16, "walk_BV": 16, "dv_BV": 16, "dv_BK": 16, "dqk_BK": 16, "dqk_BV": 16}
    fused = {"walk_BK": 32, "walk_BV": 16, "dqk_BK": 64, "dqk_BV": 16}
    for gate, tiles in ((True, small), (False, small), (True, fused)):
        x = make(2, 100, 2, 48, 40, gate=gate, s_in=True, dht=True, seed=5)
        check(x, 0.2, tiles=tiles)


def test_absent_do_and_mixed_dtypes():
    """do=None means zeros (only dht drives the gradients); fp16 q, k, v with an fp32 do
    give fp16 gradients."""
    x = make(1, 70, 2, 16, 32, gate=True, s_in=True, dht=True, seed=6)
    x["do"] = torch.zeros_like(x["v"])
    want = fp64_grads(x, 0.25)
    got = scalar_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], None, x["dht"], 0.25)
    assert not got[0].any()  # o is the only path to q
    for a, b in zip(got[1:], want[1:]):
        assert rel(a, b) <= 1e-4
    x = make(1, 70, 2, 16, 32, gate=True, s_in=False, dht=True, seed=7, dtype=torch.float16)
    got = scalar_decay_backward(x["q"], x["k"], x["v"], x["g"], None, x["do"], x["dht"], 0.25)
    want = fp64_grads(x, 0.25)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float16
    for a, b in zip(got[:4], want[:4]):
        assert rel(a, b) <= 1e-2


# ------------------------------------------------------------------------------------------
# Real GPU: bf16 at a real shape against fp32 autograd of the PyTorch chunk form.
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,V", [(16, 16), (128, 16), (16, 128)])
def test_gpu_small_head_dims(dtype, K, V):
    """Compiled for the GPU at head dims of 16 (the delta rule's 8-warp kernels with a
    16-wide tile made illegal memory accesses there): agreement with fp64 autograd (bf16:
    the inputs' own rounding)."""
    x = make(1, 80, 2, K, V, gate=True, s_in=True, dht=True, seed=2, dtype=dtype,
             device="cuda")
    check(x, K ** -0.5, tol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [True, False], ids=["simple_gla", "linear_attn"])
@pytest.mark.parametrize("K,V", [(128, 128), (256, 64)])
def test_gpu_bf16_real_shape(gate, K, V):
    from forge_dist.variants import decay_attention
    B, T, H = 1, 4096, 4
    x = make(B, T, H, K, V, gate=gate, s_in=True, dht=True, seed=11, device="cuda",
             dtype=torch.bfloat16)
    x["S_in"] = x["S_in"] * 0.1
    scale = K ** -0.5
    got = scalar_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"],
                                scale)
    names = ("q", "k", "v", "g", "S_in")
    leaves = {n: (None if x[n] is None else x[n].detach().float().requires_grad_(True))
              for n in names}
    s = decay_attention.summarize(leaves["q"], leaves["k"], leaves["v"], leaves["g"], scale,
                                  need_transition=False)
    o_p, s_p = s.readout(leaves["S_in"])
    o, ST = s.o_zero + o_p, s.delta + s_p
    ((o * x["do"].float()).sum() + (ST * x["dht"]).sum()).backward()
    for name, a, n in zip(("dq", "dk", "dv", "dg", "dS_in"), got, names):
        if leaves[n] is None:
            assert a is None
            continue
        assert rel(a, leaves[n].grad) <= 5e-3, (name, rel(a, leaves[n].grad))


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_parts_and_state_gradient_walk_match_the_whole_program(op):
    """What a sequence-parallel backward runs (forge_dist/runtime/sp_train.py): the program
    cut around the chain, in both orders, gives the whole program's gradients; the
    state-gradient walk (no chunk states stored) gives its dh0."""
    from forge_dist import kernels

    B, T, H, K, V = 1, 100, 2, 32, 32
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    gshape = (B, T, H) if op == "simple_gla" else (B, T, H, K)
    base = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V), "do": r(B, T, H, V),
            "g": -torch.rand(*gshape, generator=gen).to(DEV) * 0.3,
            "h0": r(B, H, K, V), "dht": r(B, H, K, V)}
    whole = kernels.backward_program(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32,
                                     has_h0=True, has_dht=True, gated=True,
                                     interp=DEV == "cpu")
    want = whole.execute(dict(base), DEV)
    names = [ln.kernel for ln in whole.launches]
    for first in ("chunk_states", "chunk_states_bwd"):
        i = names.index(first)
        a, b = whole.parts([[i], [j for j in range(len(names)) if j != i]])
        assert not any(buf.role == "scratch" for buf in a.buffers.values())
        carried = [n for n, buf in a.buffers.items() if buf.role == "output"]
        assert all(b.buffers[n].role == "input" for n in carried if n in b.buffers)
        got = dict(base)
        for n in carried:
            got[n] = torch.empty(a.buffers[n].shape, dtype=a.buffers[n].dtype, device=DEV)
        a.execute(got, DEV)
        b.execute(got, DEV)
        for n in ("dq", "dk", "dv", "dh0", "dg" if op == "gla" else "dg_part"):
            assert rel(got[n], want[n]) < 1e-6, (first, n)
    walk = kernels.state_grad_program(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32,
                                      has_dht=True, interp=DEV == "cpu")
    assert set(walk.buffers) == {"q", "g", "do", "dht", "dh0"}
    lam = walk.execute({n: base[n] for n in ("q", "g", "do", "dht")}, DEV)["dh0"]
    assert rel(lam, want["dh0"]) < 1e-6  # dh0 does not depend on h0
    with pytest.raises(ValueError, match="every launch index once"):
        whole.parts([[0], [0]])

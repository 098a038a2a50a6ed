"""Triton backward of the vector-decay matrix state (forge_dist.kernels.vector_backward).

Gradients of ``<o, do> + <S_T, dht>`` against torch.autograd through the fp64 token
recurrence (forge_dist.variants.reference.gla_ref).  On a CPU machine the kernels run under
TRITON_INTERPRET=1 (conftest.py) at tiny shapes; the sm_90 compile check runs Triton's
compiler in a child process without the interpreter; the ``gpu`` test runs bf16 at a real
shape against fp32 autograd of the PyTorch chunk form.  (Triton 3.6's interpreter gets
``tl.dot`` of bf16 operands wrong, so 16-bit inputs are checked in fp16 here and in bf16 only
by the ``gpu`` test.)
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels.vector_backward import kernel_specs, vector_decay_backward
from forge_dist.variants.reference import gla_ref

from .backward_common import DEV, rel, require_kernels

require_kernels()

SMEM_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)


def make(B, T, H, K, V, *, s_in=True, dht=True, steep=False, seed=0, device=DEV,
         dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    g = torch.nn.functional.logsigmoid(r(B, T, H, K) + 2)
    if steep:  # about -20 to -34 per token, every fourth key channel mild
        g = g * 20 - 20
        g[..., ::4] = torch.nn.functional.logsigmoid(r(B, T, H, K)[..., ::4] + 3)
    x = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V), "g": g,
         "S_in": r(B, H, K, V) if s_in else None, "do": r(B, T, H, V),
         "dht": r(B, H, K, V) if dht else None}
    return {n: (None if t is None else
                t.to(device, dtype if n in ("q", "k", "v") else torch.float32))
            for n, t in x.items()}


NAMES = ("q", "k", "v", "g", "S_in")


def fp64_grads(x, scale):
    """Autograd of the fp64 token recurrence: (dq, dk, dv, dg, dS_in)."""
    leaves = {n: (None if x[n] is None else x[n].detach().double().cpu().requires_grad_(True))
              for n in NAMES}
    o, ST = gla_ref(leaves["q"], leaves["k"], leaves["v"], leaves["g"], scale=scale,
                    initial_state=leaves["S_in"], output_final_state=True)
    loss = (o * x["do"].double().cpu()).sum()
    if x["dht"] is not None:
        loss = loss + (ST * x["dht"].double().cpu()).sum()
    loss.backward()
    return [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def check(x, scale, tol=1e-4, **kw):
    got = vector_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"],
                                scale, **kw)
    want = fp64_grads(x, scale)
    errs = {}
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS_in"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        errs[name] = rel(a, b)
        assert errs[name] <= tol, (name, errs[name])
    return got, want, errs


CASES = [  # (T, K, V, S_in, dht, BT)
    (1, 16, 32, True, True, 32),
    (37, 32, 16, True, True, 32),
    (64, 32, 32, False, True, 32),
    (50, 16, 32, True, False, 16),
    (45, 32, 16, False, False, 32),
]


@pytest.mark.parametrize("T,K,V,s_in,dht,BT", CASES,
                         ids=[f"T{c[0]}-K{c[1]}-V{c[2]}{'-S' if c[3] else ''}"
                              f"{'-dht' if c[4] else ''}-BT{c[5]}" for c in CASES])
def test_matches_fp64_autograd(T, K, V, s_in, dht, BT):
    x = make(1, T, 2, K, V, s_in=s_in, dht=dht, seed=T + K)
    (dq, dk, dv, dg, dS), _, _ = check(x, K ** -0.5, BT=BT)
    assert dq.dtype == dk.dtype == dv.dtype == dg.dtype == torch.float32
    assert dg.shape == (1, T, 2, K) and (dS is None) == (not s_in)


def test_several_tiles_and_batches():
    """K, V not powers of 2 and split into several tiles in every kernel, B=2, T not a
    multiple of BT: three K tiles (A partials summed by the dv kernel, which loops over K
    tiles), then one K tile with dv fused over several V tiles, then one K tile unfused."""
    small = {"walk_BK": 16, "walk_BV": 16, "dqk_BK": 16, "dqk_BV": 16, "dv_BK": 16,
             "dv_BV": 16}
    fused = {"walk_BK": 32, "walk_BV": 16, "dqk_BK": 64, "dqk_BV": 16}
    for tiles in (small, fused, dict(fused, fuse_dv=False, dv_BK=32, dv_BV=16)):
        x = make(2, 50, 1, 48, 40, seed=5)
        check(x, 0.2, tiles=tiles)


def test_steep_gates():
    """Log decays of -20..-34 per token and channel (every fourth channel mild): no NaN/Inf
    (every exponent a non-positive sum of gates) and dg accurate on the steep channels too,
    where it is O(e^-20) next to O(1) terms of the naive q.dq - k.dk form."""
    x = make(1, 64, 2, 32, 32, steep=True, seed=3)
    (_, _, _, dg, _), want, errs = check(x, 0.3, tol=1e-5)
    steep = torch.ones(32, dtype=torch.bool)
    steep[::4] = False
    w = want[3]
    assert w[..., steep].abs().max() < 1e-6  # the steep channels' dg really is tiny
    err_steep = rel(dg[..., steep], w[..., steep])
    per_channel = max(rel(dg[..., c], w[..., c]) for c in range(32))
    print(f"steep gates: dg rel err all {errs['dg']:.2e}, steep channels {err_steep:.2e}, "
          f"worst channel {per_channel:.2e}")
    assert err_steep <= 1e-5 and per_channel <= 1e-5


def _grads(x, scale, **kw):
    return vector_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"],
                                 scale, **kw)


@pytest.mark.parametrize("steep", [False, True], ids=["mild", "steep"])
def test_fast_and_exact_paths(monkeypatch, steep):
    """Both paths against fp64 autograd, each forced everywhere through ``vector.span_max``
    (-1: exact; inf: fast, mild gates only), and the default picks the fast path on mild
    gates and the exact one on steep gates (bitwise the forced result).  T = 109: a full
    64-token chunk and one of 45 (its second 32-token block partial)."""
    from forge_dist.kernels import vector

    x = make(1, 109, 2, 16, 16, steep=steep, seed=12)
    default = _grads(x, 0.3)
    monkeypatch.setattr(vector, "span_max", lambda dtype: -1.0)
    exact, _, errs = check(x, 0.3, tol=1e-5)
    print(f"exact path ({'steep' if steep else 'mild'}): {errs}")
    forced = exact
    if not steep:
        monkeypatch.setattr(vector, "span_max", lambda dtype: float("inf"))
        forced, _, errs = check(x, 0.3, tol=1e-5)
        print(f"fast path (mild): {errs}")
        assert any(not torch.equal(a, b) for a, b in zip(forced[:4], exact[:4]))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS_in"), default, forced):
        assert torch.equal(a, b), name


def test_mixed_slices(monkeypatch):
    """Steep gates on channels 16..31 only: with 16-channel slices that slice takes the exact
    path while the others stay fast, and dv (one K tile) or the A partials (several K tiles,
    _dv_kernel) still come out whole; at BT 64, 32 and 16.  The steep channels' dq, dk, dg
    are bitwise those of the all-exact run, the mild channels' are not."""
    from forge_dist.kernels import vector

    x = make(1, 45, 1, 48, 16, seed=13)
    steep = torch.zeros(48, dtype=torch.bool)
    steep[16:32] = True
    x["g"][..., steep] = x["g"][..., steep] * 20 - 20
    for BT, tiles in ((64, {"dqk_BKS": 16}), (64, {"dqk_BK": 16}), (32, {"dqk_BKS": 16}),
                      (16, {"dqk_BK": 32, "dqk_BKS": 16})):
        monkeypatch.undo()
        mixed, want, errs = check(x, 0.3, tol=1e-5, BT=BT, tiles=tiles)
        per_channel = max(rel(mixed[3][..., c], want[3][..., c]) for c in range(48))
        assert per_channel <= 1e-5, (BT, tiles, per_channel)
        monkeypatch.setattr(vector, "span_max", lambda dtype: -1.0)
        exact = _grads(x, 0.3, BT=BT, tiles=tiles)
        for a, b in zip(mixed[:2] + mixed[3:4], exact[:2] + exact[3:4]):
            assert torch.equal(a[..., steep], b[..., steep]), (BT, tiles)
            assert not torch.equal(a[..., ~steep], b[..., ~steep]), (BT, tiles)


def test_exact_kernel_chunk_groups(monkeypatch):
    """The exact kernel's programs take several chunks each (``exact_CH``), reading their
    flags a few at a time (``EXACT_BF``, 2 here): 7 chunks in groups of 5 and 2, loads of
    2, 2, 1 and 2 flags; bitwise the one-chunk-per-program result."""
    from forge_dist.kernels import vector_backward

    x = make(1, 109, 1, 16, 16, steep=True, seed=15)
    one = _grads(x, 0.3, BT=16, tiles={"exact_CH": 1})
    monkeypatch.setattr(vector_backward, "EXACT_BF", 2)
    grouped, _, _ = check(x, 0.3, tol=1e-5, BT=16, tiles={"exact_CH": 5})
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS_in"), grouped, one):
        assert torch.equal(a, b), name


def test_absent_do_and_fp16():
    """do=None means zeros (only dht drives the gradients); fp16 q, k, v with an fp32 do
    give fp16 gradients (and fp32 dg)."""
    x = make(1, 40, 2, 16, 32, seed=6)
    x["do"] = torch.zeros_like(x["v"])
    want = fp64_grads(x, 0.25)
    got = vector_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], None, x["dht"], 0.25)
    assert not got[0].any()  # o is the only path to q
    for a, b in zip(got[1:], want[1:]):
        assert rel(a, b) <= 1e-4
    x = make(1, 40, 2, 16, 32, s_in=False, seed=7, dtype=torch.float16)
    got = vector_decay_backward(x["q"], x["k"], x["v"], x["g"], None, x["do"], x["dht"], 0.25)
    want = fp64_grads(x, 0.25)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float16
    assert got[3].dtype == torch.float32
    for a, b in zip(got[:4], want[:4]):
        assert rel(a, b) <= 3e-3


def test_bad_input_names_the_argument():
    x = make(1, 8, 1, 16, 16)
    args = [x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"], 1.0]
    bad = {4: ("S_in", x["S_in"][..., :8]), 3: ("g", x["g"][..., 0]),
           1: ("k", x["k"].half()), 6: ("dht", x["dht"][0])}
    for i, (name, t) in bad.items():
        a = list(args)
        a[i] = t
        with pytest.raises(ValueError, match=name):
            vector_decay_backward(*a)
    with pytest.raises(ValueError, match="BT"):
        vector_decay_backward(*args, BT=24)
    with pytest.raises(ValueError, match="head dim"):
        vector_decay_backward(x["q"][..., :8], x["k"][..., :8], x["v"], x["g"][..., :8],
                              None, x["do"], None, 1.0)


# ------------------------------------------------------------------------------------------
# The summary backward (closed form in VectorDecayWork._summary_bwd)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steep", [False, True], ids=["mild", "steep"])
def test_summary_backward_closed_form(steep):
    """(delta, M) of a segment from a zero state: delta = S_T, M = exp(sum_t g_t) [B, H, K].
    The closed form against fp64 autograd through the token recurrence; at steep gates too
    (the shifted sums keep dg free of the O(1)-minus-O(1) differences)."""
    from forge_dist.kernels.vector import VectorDecayWork

    x = make(2, 40, 2, 16, 24, s_in=False, steep=steep, seed=9)
    if not steep:
        x["g"] = x["g"] * 0.05  # M of order one, so that dM matters
    gen = torch.Generator().manual_seed(1)
    ddelta, dM = (torch.randn(2, 2, 16, 24, generator=gen).to(DEV),
                  torch.randn(2, 2, 16, generator=gen).to(DEV))
    work = VectorDecayWork("gla", {n: x[n] for n in ("q", "k", "v", "g")}, 0.25, True)
    got = work._summary_bwd([x[n] for n in ("q", "k", "v", "g")], ddelta, dM)
    leaves = [x[n].detach().double().cpu().requires_grad_(True) for n in ("q", "k", "v", "g")]
    _, delta = gla_ref(*leaves, scale=0.25, output_final_state=True)
    M = leaves[3].sum(dim=1).exp()
    ((delta * ddelta.double().cpu()).sum() + (M * dM.double().cpu()).sum()).backward()
    assert got[0] is None  # q does not reach the summary: no gradient to add
    for name, a, b in zip("kvg", got[1:], leaves[1:]):
        assert torch.isfinite(a).all() and rel(a, b.grad) <= 1e-5, (name, rel(a, b.grad))
    no_m = work._summary_bwd([x[n] for n in ("q", "k", "v", "g")], ddelta, None)
    assert rel(no_m[1], got[1]) == 0 and no_m[3].shape == x["g"].shape


# ------------------------------------------------------------------------------------------
# The kernels compile for sm_90 (Triton's own compiler and bundled ptxas, no GPU needed)
# ------------------------------------------------------------------------------------------

def test_compiles_for_sm90_within_shared_memory(tmp_path):
    """Every launch of the default tiles at K = V = 128 bf16 (and the unfused dq/dk/dg + dv
    kernels that K = 256 uses) compiles for sm_90 and fits its shared memory.  Under the
    interpreter aot.compile_specs compiles in a child process with the interpreter off."""
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    specs = {s.key: s for s in kernel_specs(128, 128, torch.bfloat16)
             + kernel_specs(128, 128, torch.bfloat16, fuse_dv=False)}
    rep = aot.compile_specs(list(specs.values()), tmp_path / "cache", "cuda:90")
    assert sorted(rep["compiled"]) == sorted(specs)
    man = json.loads((tmp_path / "cache" / "manifest.json").read_text())["kernels"]
    kernels = {e["function"] for e in man.values()}
    assert kernels == {"_fwd_states_kernel", "_bwd_states_kernel", "_dqkg_kernel",
                       "_dqkg_exact_kernel", "_dv_kernel"}
    for e in man.values():
        assert 0 < e["shared"] <= SMEM_LIMIT, (e["function"], e["shared"])
        assert e["global_scratch_size"] == 0, e["function"]


# ------------------------------------------------------------------------------------------
# Real GPU: bf16 at a real shape against fp32 autograd of the PyTorch chunk form.
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(128, 128), (256, 64)])
def test_gpu_bf16_real_shape(K, V):
    from forge_dist.variants import decay_attention

    B, T, H = 1, 4096, 4
    x = make(B, T, H, K, V, seed=11, device="cuda", dtype=torch.bfloat16)
    x["S_in"] = x["S_in"] * 0.1
    scale = K ** -0.5
    got = vector_decay_backward(x["q"], x["k"], x["v"], x["g"], x["S_in"], x["do"], x["dht"],
                                scale)
    leaves = {n: x[n].detach().float().requires_grad_(True) for n in NAMES}
    s = decay_attention.summarize(leaves["q"], leaves["k"], leaves["v"], leaves["g"], scale,
                                  need_transition=False)
    o_p, s_p = s.readout(leaves["S_in"])
    o, ST = s.o_zero + o_p, s.delta + s_p
    ((o * x["do"].float()).sum() + (ST * x["dht"]).sum()).backward()
    for name, a, n in zip(("dq", "dk", "dv", "dg", "dS_in"), got, NAMES):
        assert torch.isfinite(a).all(), name
        assert rel(a, leaves[n].grad) <= 1e-2, (name, rel(a, leaves[n].grad))


@pytest.mark.gpu
def test_gpu_bf16_exact_and_mixed_paths():
    """bf16 at a real shape with steep gates on 16 of the 128 channels (their slice takes
    the exact kernel, the other slice the fast one) and on all channels of one head (every
    slice exact), against the same backward on fp32 copies (checked against fp64 above)."""
    B, T, H, K, V = 1, 4096, 4, 128, 128
    x = make(B, T, H, K, V, seed=14, device="cuda", dtype=torch.bfloat16)
    x["S_in"] = x["S_in"] * 0.1
    x["g"][..., 64:80] = x["g"][..., 64:80] * 20 - 20
    x["g"][:, :, 3] = x["g"][:, :, 3] * 20 - 20
    got = _grads(x, K ** -0.5)
    want = _grads({n: None if t is None else t.float() for n, t in x.items()}, K ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dS_in"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= 1e-2, (name, rel(a, b))

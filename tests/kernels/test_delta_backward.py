"""Triton backward of the delta rule (forge_dist.kernels.delta_backward).

Gradients of ``<o, do> + <S_T, dht>`` against torch.autograd through the fp64 token
recurrence (forge_dist.variants.reference.gated_delta_rule_ref; ``g=None`` is DeltaNet).  On
a CPU machine the kernels run under TRITON_INTERPRET=1 (conftest.py) at tiny shapes; the
``gpu`` test runs bf16 at a real shape against fp32 autograd of the PyTorch chunk form.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels.delta import DeltaRuleWork
from forge_dist.kernels.delta_backward import delta_rule_backward
from forge_dist.variants.reference import gated_delta_rule_ref

from .backward_common import DEV, rel, require_kernels

require_kernels()


def make(B, T, H, K, V, *, gate=True, s_in=True, dht=True, seed=0, device=DEV,
         dtype=torch.float32, gate_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)  # as GDN layers feed it
    x = {"q": r(B, T, H, K), "k": k, "v": r(B, T, H, V),
         "g": gate_scale * torch.nn.functional.logsigmoid(r(B, T, H) + 2) if gate else None,
         "beta": torch.sigmoid(r(B, T, H)), "S_in": r(B, H, K, V) if s_in else None,
         "do": r(B, T, H, V), "dht": r(B, H, K, V) if dht else None}
    return {n: None if t is None else
            t.to(device, dtype if n in ("q", "k", "v") else torch.float32)
            for n, t in x.items()}


NAMES = ("q", "k", "v", "g", "beta", "S_in")


def fp64_grads(x, scale):
    leaves = {n: None if x[n] is None else x[n].detach().double().cpu().requires_grad_(True)
              for n in NAMES}
    o, ST = gated_delta_rule_ref(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                 leaves["beta"], scale=scale, initial_state=leaves["S_in"],
                                 output_final_state=True)
    loss = (o * x["do"].double().cpu()).sum()
    if x["dht"] is not None:
        loss = loss + (ST * x["dht"].double().cpu()).sum()
    loss.backward()
    return [None if leaves[n] is None else leaves[n].grad for n in NAMES]


def check(x, scale, tol=1e-4, **kw):
    got = delta_rule_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S_in"], x["do"],
                              x["dht"], scale, **kw)
    got = [got[0], got[1], got[2], got[3], got[4], got[5]]  # dq, dk, dv, dg, dbeta, dS_in
    want = fp64_grads(x, scale)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dS_in"), got, want):
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
    (64, 16, 16, True, False, True),
    (150, 16, 32, True, True, False),
    (150, 32, 16, False, True, True),
    (37, 16, 16, False, False, False),
]


@pytest.mark.parametrize("T,K,V,gate,s_in,dht", CASES,
                         ids=[f"T{c[0]}-K{c[1]}-V{c[2]}-{'g' if c[3] else 'nog'}"
                              f"{'-S' if c[4] else ''}{'-dht' if c[5] else ''}" for c in CASES])
def test_matches_fp64_autograd(T, K, V, gate, s_in, dht):
    x = make(1, T, 2, K, V, gate=gate, s_in=s_in, dht=dht, seed=T + K)
    dq, dk, dv, dg, dbeta, dS = check(x, K ** -0.5)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    assert (dg is None) == (not gate) and (dS is None) == (not s_in)


def test_several_tiles_and_batches():
    """K and V split into several tiles in every kernel (the reverse walk's V tiles, the
    dq/dk kernel's K tiles with dG summed over them, the WY backward's two K passes), B=2,
    T not a multiple of the chunk."""
    tiles = {"walk_BV": 16, "dqk_BK": 16, "dqk_BV": 16, "wy_BK": 16, "wy_BV": 16}
    for gate in (True, False):
        x = make(2, 100, 2, 48, 40, gate=gate, seed=5)
        check(x, 0.2, tiles=tiles)


def test_steep_gates_stay_finite():
    """Log decays of -8..-20 per token: every exponent is a masked non-positive difference,
    so nothing overflows; dg is the direct form (module docstring), so only finiteness and
    the other gradients' accuracy are promised here."""
    x = make(1, 70, 2, 16, 16, seed=7, gate_scale=8.0)
    x["g"] = x["g"] - 8.0
    dq, dk, dv, dg, dbeta, dS = delta_rule_backward(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["S_in"], x["do"], x["dht"], 0.25)
    want = fp64_grads(x, 0.25)
    for a in (dq, dk, dv, dg, dbeta, dS):
        assert torch.isfinite(a).all()
    for a, b in ((dq, want[0]), (dk, want[1]), (dv, want[2]), (dbeta, want[4]), (dS, want[5])):
        assert rel(a, b) < 1e-4
    assert (dg.double().cpu() - want[3]).abs().max() < 1e-3 * want[3].abs().max() + 1e-5


def test_bad_input_is_named():
    x = make(1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="^beta: expected shape"):
        delta_rule_backward(x["q"], x["k"], x["v"], x["g"], x["beta"][:, :4], None, x["do"],
                            None, 0.25)
    with pytest.raises(ValueError, match="^q, k, v: dtypes differ"):
        delta_rule_backward(x["q"], x["k"], x["v"].double(), x["g"], x["beta"], None, x["do"],
                            None, 0.25)


def test_work_backward_uses_triton_and_matches_fp64(monkeypatch):
    """The work's finish and summary (delta and the dense M) take the Triton backward (the
    PyTorch recompute would raise here) and give the fp64 gradients."""
    x = make(1, 40, 2, 16, 16, seed=11)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    S_in = x["S_in"].clone().requires_grad_(True)
    work = DeltaRuleWork("gated_delta_rule", dict(leaves), 0.25, True)
    monkeypatch.setattr(DeltaRuleWork, "_finish_torch", lambda *a: 1 / 0)
    monkeypatch.setattr(DeltaRuleWork, "_summary_torch", lambda *a: 1 / 0)
    delta, M = work.summary(True)
    o, ht = work.finish(S_in)
    gen = torch.Generator().manual_seed(3)
    w = [torch.randn(t.shape, generator=gen).to(DEV) for t in (delta, M, o, ht)]
    sum((a * b).sum() for a, b in zip((delta, M, o, ht), w)).backward()

    ref = {n: x[n].detach().double().cpu().requires_grad_(True)
           for n in ("q", "k", "v", "g", "beta")}
    s_ref = x["S_in"].detach().double().cpu().requires_grad_(True)
    args = (ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"])
    o_r, ht_r = gated_delta_rule_ref(*args, scale=0.25, initial_state=s_ref,
                                     output_final_state=True)
    _, d_r = gated_delta_rule_ref(*args, scale=0.25, output_final_state=True)
    eye = torch.eye(16, dtype=torch.float64).expand(1, 2, 16, 16)
    _, M_r = gated_delta_rule_ref(ref["q"], ref["k"], torch.zeros(1, 40, 2, 16,
                                  dtype=torch.float64), ref["g"], ref["beta"], scale=0.25,
                                  initial_state=eye, output_final_state=True)
    wd = [t.double().cpu() for t in w]
    ((d_r * wd[0]).sum() + (M_r * wd[1]).sum() + (o_r * wd[2]).sum()
     + (ht_r * wd[3]).sum()).backward()
    for n in ("q", "k", "v", "g", "beta"):
        assert rel(leaves[n].grad, ref[n].grad) < 1e-4, n
    assert rel(S_in.grad, s_ref.grad) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,V", [(16, 16), (16, 32), (32, 16), (128, 16)])
def test_gpu_small_head_dims(dtype, K, V):
    """Compiled for the GPU, the dq/dk and WY backward kernels at 8 warps with a 16-wide tile
    made illegal memory accesses (Triton 3.6, H100); with 4 warps there they agree with fp64
    autograd (bf16: the inputs' own rounding)."""
    x = make(1, 80, 2, K, V, seed=2, dtype=dtype, device="cuda")
    check(x, K ** -0.5, tol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
def test_bf16_at_a_real_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = make(1, 4096, 4, 128, 128, seed=1, dtype=torch.bfloat16, device="cuda")
    got = delta_rule_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["S_in"], x["do"],
                              x["dht"], 128 ** -0.5)
    # fp32 autograd of the PyTorch chunk form
    from forge_dist.variants import delta_rule

    leaves = {n: x[n].float().requires_grad_(True) for n in NAMES}
    summ = delta_rule.summarize(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                leaves["beta"], 128 ** -0.5, need_transition=False)
    o_part, s_part = summ.readout(leaves["S_in"])
    ((( summ.o_zero + o_part) * x["do"]).sum()
     + ((summ.delta + s_part) * x["dht"]).sum()).backward()
    for name, a in zip(NAMES, (got[0], got[1], got[2], got[3], got[4], got[5])):
        assert rel(a, leaves[name].grad) < 2e-2, name


def test_backward_kernels_compile_for_sm90(tmp_path):
    """Every launch of the backward (incl. the WY kernel keeping X and the walker keeping the
    chunk states) compiles for Hopper with Triton's own compiler and ptxas, no GPU needed,
    within one SM's shared memory."""
    import json

    from forge_dist.kernels.delta_backward import kernel_specs
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    specs = kernel_specs(128, 128)
    rep = aot.compile_specs(specs, tmp_path / "cache")
    assert sorted(rep["compiled"]) == sorted(s.key for s in specs), rep
    kernels = json.loads((tmp_path / "cache" / "manifest.json").read_text())["kernels"]
    for key, entry in kernels.items():
        assert 0 < entry["shared"] <= 232448, entry


@pytest.mark.parametrize("gate", [True, False])
def test_state_gradient_walk_gives_the_backward_dh0(gate):
    """The WY factors and the reverse walk alone, storing no chunk states
    (``kernels.state_grad_program``): the incoming state's gradient of the fp64 backward."""
    from forge_dist import kernels

    B, T, H, K, V = 1, 100, 2, 32, 16
    x = make(B, T, H, K, V, gate=gate, seed=7)
    scale = K ** -0.5
    walk = kernels.state_grad_program("gated_delta_rule", B=B, T=T, H=H, K=K, V=V,
                                      dtype=torch.float32, has_dht=True, gated=gate,
                                      scale=scale, interp=DEV == "cpu")
    assert not {"hc", "dhc", "vn", "dvn"} & set(walk.buffers)
    given = {n: x[n] for n in ("q", "k", "v", "beta", "do", "dht")}
    if gate:
        given["g"] = x["g"]
    lam = walk.execute(given, DEV)["dh0"]
    want = fp64_grads(x, scale)[-1]
    assert rel(lam, want) < 1e-4

"""Triton backward of the vector state (hgrn): forge_dist.kernels.vector_state.hgrn_backward.

Gradients of ``<o, do> + <h_T, dht>`` against torch.autograd through the fp64 token
recurrence (forge_dist.variants.reference.hgrn_ref).  On a CPU machine the kernels run under
TRITON_INTERPRET=1 (conftest.py) at tiny shapes; the ``gpu`` test runs bf16 at the
benchmark's width against fp32 autograd of the PyTorch chunk form.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels.vector_state import HgrnBackward, VectorStateWork, hgrn_backward
from forge_dist.variants.reference import hgrn_ref

from .backward_common import DEV, rel, require_kernels

require_kernels()


def make(B, T, D, *, s_in=True, do=True, dht=True, steep=False, seed=0, dtype=torch.float32,
         device=DEV):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    g = torch.nn.functional.logsigmoid(r(B, T, D) + 2)
    if steep:  # about -20 to -34 per token on half the channels, mild on the rest
        g[..., ::2] = g[..., ::2] * 20 - 20
    x = {"x": r(B, T, D), "g": g, "S_in": r(B, D) if s_in else None,
         "do": r(B, T, D) if do else None, "dht": r(B, D) if dht else None}
    return {n: None if t is None else t.to(device, dtype if n == "x" else torch.float32)
            for n, t in x.items()}


def fp64_grads(x):
    leaves = {n: None if x[n] is None else x[n].detach().double().cpu().requires_grad_(True)
              for n in ("x", "g", "S_in")}
    o, hT = hgrn_ref(leaves["x"], leaves["g"], initial_state=leaves["S_in"],
                     output_final_state=True)
    loss = 0 * o.sum()
    if x["do"] is not None:
        loss = loss + (o * x["do"].double().cpu()).sum()
    if x["dht"] is not None:
        loss = loss + (hT * x["dht"].double().cpu()).sum()
    loss.backward()
    return {n: None if t is None else t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("T,BD,n_seg", [(37, 8, 1), (64, 16, 1), (5, 32, 1), (37, 8, 3),
                                        (64, 16, 4), (5, 8, 7)])
@pytest.mark.parametrize("s_in,do,dht", [(True, True, True), (False, True, False),
                                         (True, False, True)])
def test_matches_fp64_autograd(T, BD, n_seg, s_in, do, dht):
    """One walk, and DECOUPLED over segments (the last case: more segments asked for than
    tokens exist); channel tiles narrower and wider than D."""
    x = make(2, T, 20, s_in=s_in, do=do, dht=dht, seed=T)
    dx, dg, dS = hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"], BD=BD,
                               n_seg=n_seg)
    ref = fp64_grads(x)
    assert rel(dx, ref["x"]) < 1e-5
    assert rel(dg, ref["g"]) < 1e-5
    if s_in:
        assert rel(dS, ref["S_in"]) < 1e-5
    else:
        assert dS is None


@pytest.mark.parametrize("n_seg", [1, 3])
def test_steps_around_the_reverse_chain(n_seg):
    """HgrnBackward as a sequence-parallel rank runs it: the segments' reverse summaries,
    the incoming state's gradient for one final-state gradient (the scan alone), then the
    gradients for another (what arrives from the next rank): each equals the whole
    backward with that final-state gradient, and the first leaves the second untouched."""
    x = make(2, 37, 20, seed=5)
    other = torch.randn(2, 20, generator=torch.Generator().manual_seed(6)).to(x["dht"])
    steps = HgrnBackward(x["x"], x["g"], x["S_in"], x["do"], BD=8, n_seg=n_seg)
    steps.summaries()
    own = steps.state_grad(x["dht"])
    dx, dg, dS = steps.finish(other)
    assert rel(own, fp64_grads(x)["S_in"]) < 1e-5
    ref = fp64_grads(dict(x, dht=other))
    assert rel(dx, ref["x"]) < 1e-5 and rel(dg, ref["g"]) < 1e-5
    assert rel(dS, ref["S_in"]) < 1e-5
    with pytest.raises(RuntimeError, match="run summaries"):
        HgrnBackward(x["x"], x["g"], None, x["do"], n_seg=n_seg).state_grad(None)


@pytest.mark.parametrize("BT", [1, 4, 16])
@pytest.mark.parametrize("T,n_seg", [(37, 1), (37, 3), (16, 2)])
def test_token_blocks(monkeypatch, BT, T, n_seg):
    """The walks load BT tokens per step (the next block in flight) and scan them on chip:
    one token per step, blocks that divide the segments, blocks with padded rows past T and
    at segment ends; forward outputs and final state, and every gradient."""
    from forge_dist.kernels import vector_state as vs

    monkeypatch.setitem(vs.FUSED_CONFIG, "BT", BT)
    monkeypatch.setitem(vs.BWD_CONFIG, "BT", BT)
    x = make(2, T, 20, seed=BT + T)
    o, hT = vs.hgrn_forward(x["x"], x["g"], x["S_in"], out_dtype=torch.float32, n_seg=n_seg)
    o_ref, hT_ref = hgrn_ref(x["x"].double().cpu(), x["g"].double().cpu(),
                             initial_state=x["S_in"].double().cpu(), output_final_state=True)
    assert rel(o, o_ref) < 1e-5 and rel(hT, hT_ref) < 1e-5
    dx, dg, dS = hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"], BD=16,
                               n_seg=n_seg)
    ref = fp64_grads(x)
    assert rel(dx, ref["x"]) < 1e-5 and rel(dg, ref["g"]) < 1e-5
    assert rel(dS, ref["S_in"]) < 1e-5


def test_steep_gates_keep_relative_precision():
    """At g ~ -20..-34 per token dg is ~1e-9 of x; its three-factor product keeps fp32's
    relative precision per element (a difference form would lose it all)."""
    x = make(1, 48, 16, steep=True, seed=3)
    dx, dg, dS = hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"], BD=16, n_seg=2)
    ref = fp64_grads(x)
    assert torch.isfinite(dg).all() and torch.isfinite(dx).all()
    steep = ref["g"][..., ::2]
    assert steep.abs().max() < 1e-6  # the gradients really are tiny there
    assert rel(dg[..., ::2], steep) < 1e-5
    assert rel(dg, ref["g"]) < 1e-5 and rel(dx, ref["x"]) < 1e-5


@pytest.mark.parametrize("n_seg", [1, 3])
def test_kept_states_give_the_recomputed_gradients(n_seg):
    """``h=`` (the forward's outputs, kept by the op) replaces the recompute: same
    gradients, and a wrong shape is named."""
    from forge_dist.kernels.vector_state import hgrn_forward

    x = make(2, 37, 20, seed=11)
    h, _ = hgrn_forward(x["x"], x["g"], x["S_in"], out_dtype=torch.float32, n_seg=n_seg)
    kept = hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"], BD=16, n_seg=n_seg, h=h)
    ref = fp64_grads(x)
    for got, name in zip(kept, ("x", "g", "S_in")):
        assert rel(got, ref[name]) < 1e-5
    with pytest.raises(ValueError, match="^h: expected shape"):
        hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"], h=h[:, :5])


def test_finish_backward_reads_the_saved_outputs(monkeypatch):
    """The work's finish keeps its outputs for the backward, which then runs no forward
    kernel (the recompute would raise here); gradients as fp64 autograd."""
    from forge_dist.kernels import vector_state as vs

    x = make(2, 33, 12, seed=6)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("x", "g")}
    S_in = x["S_in"].reshape(2, 1, 12, 1).clone().requires_grad_(True)
    o, ht = VectorStateWork("hgrn", dict(leaves), None, False).finish(S_in)
    monkeypatch.setattr(vs, "hgrn_forward", lambda *a, **k: 1 / 0)
    ((o * x["do"]).sum() + (ht.reshape(2, 12) * x["dht"]).sum()).backward()
    ref = fp64_grads(x)
    assert rel(leaves["x"].grad, ref["x"]) < 1e-5 and rel(leaves["g"].grad, ref["g"]) < 1e-5
    assert rel(S_in.grad.reshape(2, 12), ref["S_in"]) < 1e-5


def test_bad_shapes_are_named():
    x = make(1, 8, 4)
    with pytest.raises(ValueError, match="^g: expected shape"):
        hgrn_backward(x["x"], x["g"][:, :4], None, x["do"], None)
    with pytest.raises(ValueError, match="^dht: expected shape"):
        hgrn_backward(x["x"], x["g"], None, x["do"], x["dht"][:, :2])


def test_work_backward_uses_triton_and_matches_torch(monkeypatch):
    """The work's finish and summary take the Triton backward (the PyTorch recompute would
    raise here) and give autograd's gradients, incl. the transition M."""
    x = make(2, 40, 12, seed=5)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("x", "g")}
    S_in = x["S_in"].reshape(2, 1, 12, 1).clone().requires_grad_(True)
    work = VectorStateWork("hgrn", dict(leaves), None, True)
    monkeypatch.setattr(VectorStateWork, "_finish_torch", lambda *a: 1 / 0)
    monkeypatch.setattr(VectorStateWork, "_summary_torch", lambda *a: 1 / 0)
    delta, M = work.summary(True)
    o, ht = work.finish(S_in)
    gen = torch.Generator().manual_seed(9)
    w = [torch.randn(t.shape, generator=gen).to(DEV) for t in (delta, M, o, ht)]
    loss = sum((a * b).sum() for a, b in zip((delta, M, o, ht), w))
    loss.backward()

    ref = {n: x[n].detach().double().cpu().requires_grad_(True) for n in ("x", "g")}
    s_ref = x["S_in"].detach().double().cpu().requires_grad_(True)
    o_r, ht_r = hgrn_ref(ref["x"], ref["g"], initial_state=s_ref, output_final_state=True)
    _, d_r = hgrn_ref(ref["x"], ref["g"], output_final_state=True)
    M_r = ref["g"].sum(1).exp()
    wd = [t.double().cpu() for t in w]
    loss_r = ((d_r * wd[0].reshape(2, 12)).sum() + (M_r * wd[1].reshape(2, 12)).sum()
              + (o_r * wd[2]).sum() + (ht_r * wd[3].reshape(2, 12)).sum())
    loss_r.backward()
    assert rel(leaves["x"].grad, ref["x"].grad) < 1e-5
    assert rel(leaves["g"].grad, ref["g"].grad) < 1e-5
    assert rel(S_in.grad.reshape(2, 12), s_ref.grad) < 1e-5


@pytest.mark.gpu
def test_bf16_at_benchmark_width():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = make(1, 8192, 4096, seed=1, dtype=torch.bfloat16, device="cuda")
    dx, dg, dS = hgrn_backward(x["x"], x["g"], x["S_in"], x["do"], x["dht"])
    # fp32 autograd of the PyTorch chunk form (the token loop is too slow at this size)
    from forge_dist.variants import vector_state

    xf = x["x"].float().requires_grad_(True)
    gf = x["g"].clone().requires_grad_(True)
    sf = x["S_in"].clone().requires_grad_(True)
    summ = vector_state.summarize(xf, gf, need_transition=False)
    o_part, s_part = summ.readout(sf[:, None, :, None])
    o = summ.o_zero + o_part
    hT = summ.delta.reshape(1, -1) + s_part.reshape(1, -1)
    ((o * x["do"]).sum() + (hT * x["dht"]).sum()).backward()
    assert rel(dx, xf.grad) < 1e-2
    assert rel(dg, gf.grad) < 1e-2
    assert rel(dS, sf.grad) < 1e-2


def test_backward_kernel_compiles_for_sm90(tmp_path):
    """The kernel compiles for Hopper (Triton's own compiler and ptxas, no GPU needed) at the
    default tiles, within the shared memory of one SM."""
    import json

    from forge_dist.kernels.vector_state import backward_kernel_specs
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    specs = backward_kernel_specs(4096)
    rep = aot.compile_specs(specs, tmp_path / "cache")
    assert sorted(rep["compiled"]) == sorted(s.key for s in specs), rep
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    for entry in manifest["kernels"].values():
        assert 0 <= entry["shared"] <= 232448, entry

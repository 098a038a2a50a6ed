"""Fused input prologues (``maps``): the kernels reading raw inputs and mapping each tile
must equal the same kernels on inputs mapped beforehand, forward (both schedules, ragged T,
a head dim with padded columns, gla's steep-gate path) and backward (through the works'
autograd), and plans with maps must equal plans without on the mapped inputs."""
from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

pytest.importorskip("triton")

from forge_dist import kernels  # noqa: E402
from forge_dist.dsl import codegen  # noqa: E402
from forge_dist.kernels.work import InputMap  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)


def input_map(f) -> InputMap:
    gm = fx.symbolic_trace(f)
    fn, _ = codegen.triton_map([n for n in gm.graph.nodes if n.op != "output"])
    return InputMap(fn, f)


# maps with f(0) != 0, so a padded row or column that is not zeroed again shows
FEATURE = input_map(lambda x: F.elu(x) + 1.0)
VALUE = input_map(lambda x: torch.sigmoid(x) * 2.0)
GATE = input_map(lambda x: F.logsigmoid(x + 2.0))
STEEP = input_map(lambda x: F.logsigmoid(x) * 8.0 - 4.0)  # spans past gla's limit per chunk
X_MAP = input_map(lambda x: F.silu(x) + 0.5)


def rel(a, b):
    """Relative error (absolute where ``b`` is 0, e.g. a steep gate's total decay)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


def raw_inputs(variant, B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    if variant == "hgrn":
        return {"x": r(B, T, K), "g": r(B, T, K)}
    inp = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V)}
    if variant == "simple_gla":
        inp["g"] = r(B, T, H)
    elif variant == "gla":
        inp["g"] = r(B, T, H, K)
    return inp


def maps_for(variant, steep=False):
    if variant == "hgrn":
        return {"x": X_MAP, "g": GATE}
    maps = {"q": FEATURE, "k": FEATURE, "v": VALUE}
    if variant != "linear_attn":
        maps["g"] = STEEP if steep else GATE
    return maps


def premapped(inp, maps):
    return {n: (maps[n].torch(t.float()) if n in maps else t) for n, t in inp.items()}


CASES = [("linear_attn", "fused", 37, 24), ("linear_attn", "decoupled", 70, 16),
         ("simple_gla", "fused", 37, 24), ("simple_gla", "decoupled", 70, 16),
         ("gla", "fused", 37, 24), ("gla", "decoupled", 70, 16), ("gla", "steep", 37, 16),
         ("hgrn", "fused", 37, 24), ("hgrn", "decoupled", 70, 40)]


@pytest.mark.parametrize("variant,execution,T,K", CASES)
def test_fused_maps_equal_premapped_inputs(variant, execution, T, K):
    B, H, V = 2, 2, 16
    steep = execution == "steep"
    ex = None if steep else execution
    inp = raw_inputs(variant, B, T, H, K, V)
    maps = maps_for(variant, steep)
    h0 = (torch.randn(B, 1, K, 1) if variant == "hgrn" else torch.randn(B, H, K, V)).to(DEV)
    fused = kernels.make_work(variant, inp, 0.5, False, execution=ex, maps=maps)
    plain = kernels.make_work(variant, premapped(inp, maps), 0.5, False, execution=ex)
    o1, s1 = fused.finish(h0)
    o2, s2 = plain.finish(h0)
    assert rel(o1, o2) < 1e-5 and rel(s1, s2) < 1e-5
    if ex is not None:
        assert fused.execution == ex
    # the shard summary (sequence parallelism's first phase) maps too
    fused = kernels.make_work(variant, inp, 0.5, True, execution=ex, maps=maps)
    plain = kernels.make_work(variant, premapped(inp, maps), 0.5, True, execution=ex)
    (d1, m1), (d2, m2) = fused.summary(True), plain.summary(True)
    assert rel(d1, d2) < 1e-5
    if m2 is not None:
        assert rel(m1, m2) < 1e-5


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "hgrn"])
def test_fused_maps_backward(variant):
    """Gradients of the raw inputs through summary + finish (a rank's two phases), against
    autograd through the PyTorch maps into the unmapped works."""
    B, T, H, K, V = 1, 37, 2, 16, 16
    base = raw_inputs(variant, B, T, H, K, V, seed=3)
    maps = maps_for(variant)
    h0 = (torch.randn(B, 1, K, 1) if variant == "hgrn" else torch.randn(B, H, K, V)).to(DEV)
    grads = []
    for fused in (True, False):
        inp = {n: t.clone().requires_grad_() for n, t in base.items()}
        s0 = h0.clone().requires_grad_()
        if fused:
            work = kernels.make_work(variant, inp, 0.5, True, maps=maps)
        else:
            work = kernels.make_work(variant, premapped(inp, maps), 0.5, True)
        delta, M = work.summary(True)
        o, s = work.finish(s0)
        loss = o.float().pow(2).sum() + s.sum() + delta.pow(2).sum()
        if M is not None:
            loss = loss + M.sum()
        loss.backward()
        grads.append([inp[n].grad for n in inp] + [s0.grad])
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-5


def test_maps_are_refused_where_not_fused():
    inp = raw_inputs("linear_attn", 1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="maps"):
        kernels.make_work("linear_attn", inp, 1.0, False, maps={"g": GATE})
    inp = dict(raw_inputs("linear_attn", 1, 8, 1, 16, 16), beta=torch.rand(1, 8, 1).to(DEV))
    with pytest.raises(ValueError, match="gated_delta_rule"):
        kernels.make_work("gated_delta_rule", inp, 1.0, False, maps={"q": FEATURE})


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "hgrn"])
def test_plans_with_maps(variant):
    """A plan with maps equals the plain plan on mapped inputs; the ops' cache keeps one
    plan for repeated calls with the same maps."""
    from forge_dist.ops import planned
    from forge_dist.runtime import PlanError, cache, plan

    B, T, H, K, V = 1, 45, 2, 16, 16
    inp = raw_inputs(variant, B, T, H, K, V, seed=5)
    maps = maps_for(variant)
    kmaps = {n: m.kernel for n, m in maps.items()}
    mapped = premapped(inp, maps)
    if variant == "hgrn":
        kw = dict(B=B, T=T, D=K, dtype=torch.float32, device=DEV)
        names = ["x", "g"]
    else:
        kw = dict(B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, scale=0.5, device=DEV)
        names = ["q", "k", "v"] + (["g"] if variant != "linear_attn" else [])
    with torch.no_grad():
        p = plan(variant, maps=kmaps, **kw)
        o1, _ = p.run(*[inp[n] for n in names])
        o2, _ = plan(variant, **kw).run(*[mapped[n].float() for n in names])
    assert rel(o1, o2) < 1e-5
    assert any("fused prologues" in n for n in p.notes)
    if variant != "hgrn":
        with pytest.raises(PlanError, match="gated_delta_rule"):
            plan("gated_delta_rule", maps={"q": FEATURE.kernel}, **kw)
    cache.clear()
    with torch.no_grad():
        for _ in range(2):
            if variant == "hgrn":
                out = planned.hgrn_call(inp["x"], inp["g"], initial_state=None,
                                        output_final_state=False, cu_seqlens=None, group=None,
                                        use_kernels=True, maps=kmaps)
            else:
                out = planned.matrix_call(variant, inp["q"], inp["k"], inp["v"],
                                          {"g": inp.get("g"), "beta": None}, scale=0.5,
                                          initial_state=None, output_final_state=False,
                                          cu_seqlens=None, group=None, use_kernels=True,
                                          maps=kmaps)
            assert out is not None and rel(out[0], o1) < 1e-6
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 1

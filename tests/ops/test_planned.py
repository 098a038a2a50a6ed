"""The ops' short path (forge_dist/ops/planned.py): no-grad calls on one device run a cached
plan.  Under the Triton interpreter (CPU) with ``FORGE_DIST_KERNELS=triton``: every op's
short path equals its general path, is taken only when eligible, and reuses its plan."""

import pytest
import torch
import torch.nn.functional as F

from forge_dist import ops
from forge_dist.kernels import interpreting
from forge_dist.runtime import cache

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 "
                                       "before triton is imported) or a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, K, V, D = 1, 80, 2, 16, 32, 32


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    monkeypatch.delenv("FORGE_DIST_OPS_PLANS", raising=False)
    cache.clear()


def _inputs(op, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if op == "hgrn":
        t = {"x": r(B, T, D), "g": F.logsigmoid(r(B, T, D) + 2)}
    else:
        t = {"q": r(B, T, H, K), "k": F.normalize(r(B, T, H, K), dim=-1), "v": r(B, T, H, V)}
        if op in ("simple_gla", "gated_delta_rule"):
            t["g"] = F.logsigmoid(r(B, T, H) + 2)
        if op == "gla":
            t["g"] = F.logsigmoid(r(B, T, H, K) + 2)
        if op == "gated_delta_rule":
            t["beta"] = torch.rand(B, T, H, generator=gen)
    return {n: x.to(DEV).requires_grad_(requires_grad) for n, x in t.items()}


def _call(op, t, **kw):
    if op == "gated_delta_rule":
        return ops.gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    return getattr(ops, op)(*t.values(), **kw)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]


@pytest.mark.parametrize("op", OPS)
def test_short_path_equals_general_path(op, monkeypatch):
    t = _inputs(op)
    h0 = (torch.randn(B, D) if op == "hgrn" else torch.randn(B, H, K, V)).to(DEV)
    with torch.no_grad():
        o, s = _call(op, t, initial_state=h0, output_final_state=True)
        assert cache.stats()["misses"] == 1  # the short path made a plan
        o2, _ = _call(op, t, initial_state=h0, output_final_state=True)
        assert cache.stats()["hits"] == 1 and torch.equal(o, o2)
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "0")
        o_ref, s_ref = _call(op, t, initial_state=h0, output_final_state=True)
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 1
    assert o.dtype == o_ref.dtype and s.shape == s_ref.shape
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("case", ["grad", "cu_seqlens", "non-contiguous", "fp16", "fp64"])
def test_ineligible_calls_take_the_general_path(case):
    t = _inputs("simple_gla", requires_grad=case == "grad")
    kw = {}
    if case == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor([0, 30, T])
    if case == "non-contiguous":
        t["q"] = t["q"].transpose(1, 2).contiguous().transpose(1, 2)
    if case == "fp16":
        t = {n: (x.half() if n in "qkv" else x) for n, x in t.items()}
    if case == "fp64":
        t = {n: x.double() for n, x in t.items()}
    o, _ = _call("simple_gla", t, **kw)
    assert cache.stats()["misses"] == 0 and cache.stats()["hits"] == 0
    if case == "grad":
        o.float().sum().backward()
        assert t["q"].grad is not None


def test_a_wrong_initial_state_still_gets_the_general_paths_error():
    t = _inputs("simple_gla")
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state"):
        _call("simple_gla", t, initial_state=torch.zeros(B, H, K, V + 1, device=DEV))
    assert cache.stats()["misses"] == 0


def test_bad_switch_is_named(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "yes")
    with torch.no_grad(), pytest.raises(ValueError, match="FORGE_DIST_OPS_PLANS"):
        _call("linear_attn", _inputs("linear_attn"))


def test_gated_delta_rule_with_fp32_g_and_bf16_beta_takes_the_short_path(monkeypatch):
    """FLA's usual gates (fp32 g, beta in the activation dtype) get a plan with a beta
    buffer of its own dtype (they took the general path before), equal to the reference."""
    from forge_dist.variants import reference as ref

    if interpreting():  # the interpreter multiplies bf16 as raw bits without the shim
        from triton.runtime import interpreter as it

        from forge_dist.kernels._common import interpreter_bf16_dot
        monkeypatch.setattr(it.InterpreterBuilder, "create_dot",
                            interpreter_bf16_dot(it.InterpreterBuilder.create_dot))
    t = {n: (x.bfloat16() if n in ("q", "k", "v", "beta") else x)
         for n, x in _inputs("gated_delta_rule").items()}
    with torch.no_grad():
        o, _ = _call("gated_delta_rule", t)
    assert cache.stats()["misses"] == 1 and o.dtype == torch.bfloat16
    o_ref, _ = ref.gated_delta_rule_ref(*[t[n].double() for n in ("q", "k", "v", "g", "beta")])
    assert _rel(o, o_ref) < 2e-2


def test_a_bad_strategy_is_refused_on_the_short_path_too():
    with torch.no_grad(), pytest.raises(ValueError, match="strategy"):
        _call("linear_attn", _inputs("linear_attn"), strategy="ring-allreduce")
    assert cache.stats()["misses"] == 0

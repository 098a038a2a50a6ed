"""DSL-only variants and the DSL built-ins vs fp64 references, one process and 2 gloo ranks,
every strategy, dense and packed (cu_seqlens) layouts, forward and backward."""
import functools

import pytest
import torch

from forge_dist import ops
from forge_dist.dsl import builtins, library

from ..sp.distributed import run_world
from .cases import NEW, STRATEGIES, problem, run_case, world_rows

TOL64, TOL32 = 1e-10, 1e-4


@pytest.mark.parametrize("name", NEW + ("gated_delta_rule", "hgrn"))
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_world1_fp64(name, varlen):
    errs = run_case(name, "auto", varlen, T_local=37)
    assert max(errs.values()) < TOL64, errs
    assert {"o", "final_state", "d_initial_state"} <= set(errs) and len(errs) >= 5


@pytest.mark.parametrize("name", NEW)
def test_world1_fp32(name):
    errs = run_case(name, "auto", False, T_local=37, dtype=torch.float32)
    assert max(errs.values()) < TOL32, errs


@functools.lru_cache(maxsize=None)
def _world2():
    rows = run_world(2, world_rows, NEW + ("gated_delta_rule",),
                     env={"FORGE_DIST_TIMEOUT": "120"})
    return {(r["name"], r["strategy"], r["varlen"]): r["errors"] for r in rows}


@pytest.mark.parametrize("name", NEW + ("gated_delta_rule",))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_world2_gloo(name, strategy, varlen):
    errs = _world2()[(name, strategy, varlen)]
    assert max(errs.values()) < TOL64, errs
    assert {"o", "final_state", "d_initial_state"} <= set(errs)


def _ops_call(name, x, **kw):
    if name == "simple_gla":
        return ops.simple_gla(x["q"], x["k"], x["v"], x["g"], **kw)
    if name == "gla":
        return ops.gla(x["q"], x["k"], x["v"], x["g"], **kw)
    return getattr(ops, name)(*x.values(), **kw)


@pytest.mark.parametrize("name", list(builtins.BUILTINS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_builtin_matches_ops(name, dtype):
    """Built-ins written in the DSL equal the hand-written forge_dist.ops (forward, state,
    gradients), on a ragged length with cu_seqlens."""
    x, h0, cu = problem("hgrn" if name == "hgrn" else "gated_delta_rule", 53, varlen=True)
    if name in ("linear_attn", "simple_gla", "gla"):
        x = {k: x[k] for k in ("q", "k", "v")}
        if name == "simple_gla":
            x["g"] = torch.nn.functional.logsigmoid(torch.randn(1, 53, 2, dtype=torch.float64) + 2)
        if name == "gla":
            x["g"] = torch.nn.functional.logsigmoid(torch.randn(1, 53, 2, 6, dtype=torch.float64) + 2)
    outs = []
    for fn in (builtins.BUILTINS[name], lambda *a, **k: _ops_call(name, dict(zip(x, a)), **k)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in x.values()]
        init = h0.to(dtype).clone().requires_grad_()
        o, s = fn(*leaves, initial_state=init, output_final_state=True, cu_seqlens=cu)
        (o.sum() + (s * s).sum()).backward()
        outs.append([o, s, init.grad] + [t.grad for t in leaves])
    tol = TOL64 if dtype == torch.float64 else TOL32
    for a, b in zip(*outs):
        err = ((a - b).norm() / b.norm()).item()
        assert err < tol, (name, err)


def test_kinds():
    assert builtins.linear_attn.kind.value == "identity"
    assert builtins.simple_gla.kind.value == "scalar"
    assert builtins.gla.kind.value == "diagonal"
    assert builtins.gated_delta_rule.kind.value == "dense"
    assert builtins.hgrn.kind.value == "diagonal" and builtins.hgrn.vector
    assert library.elu_linear_attn.kind.value == "identity"
    assert library.retnet.kind.value == "scalar"
    assert library.rg_lru.kind.value == "diagonal" and library.rg_lru.vector

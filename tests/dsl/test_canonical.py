"""Canonical graphs (forge_dist.dsl.canonical), elementwise DAG prologues, role matching."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from forge_dist import dsl
from forge_dist.dsl import DSLError, builtins, lowering, roles
from forge_dist.dsl.canonical import canonicalise


def ops_of(f):
    """``[(target, args with nodes as their op names)]`` of the canonical graph of ``f``."""
    gm = canonicalise(fx.symbolic_trace(f))
    names = {}
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = "x"
        elif n.op == "call_function":
            names[n] = getattr(n.target, "__name__", str(n.target))
            out.append((n.target, tuple(names.get(a, a) for a in n.args)))
    return out, gm


RELU_SQUARED = [(torch.relu, ("x",)), (torch.square, ("relu",))]


@pytest.mark.parametrize("f", [
    lambda x: F.relu(x) ** 2,
    lambda x: F.relu(x) * F.relu(x),  # two relu nodes: CSE, then x * x
    lambda x: x.relu().square(),
    lambda x: torch.square(torch.relu(x)),
    lambda x: torch.pow(x.clamp(min=0), 2),
    lambda x: torch.where(x > 0, x, 0.0) ** 2.0,
    lambda x: torch.mul(F.relu(x, inplace=False), x.relu()),
], ids=["pow", "mul-shared", "methods", "square", "clamp-pow", "where", "torch-mul"])
def test_one_graph_for_every_spelling_of_squared_relu(f):
    got, gm = ops_of(f)
    assert got == RELU_SQUARED
    x = torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(gm(x), F.relu(x) ** 2)


@pytest.mark.parametrize("p,want", [
    (1, []), (3, [torch.square, operator.mul]), (4, [torch.square, torch.square]),
    (5, [torch.square, torch.square, operator.mul]), (0.5, [torch.sqrt]),
    (-1, [operator.truediv]), (-0.5, [torch.rsqrt]), (2.5, [operator.pow]),
])
def test_powers(p, want):
    got, gm = ops_of(lambda x: x ** p)
    assert [t for t, _ in got] == want
    x = torch.rand(20, dtype=torch.float64) + 0.5
    torch.testing.assert_close(gm(x), x ** p)


def test_common_subexpressions_and_constants():
    got, gm = ops_of(lambda x: torch.sigmoid(x) * 2.0 + 2.0 * torch.sigmoid(x) + x.add(1.0)
                     - torch.add(x, 1.0))
    targets = [t for t, _ in got]
    # one sigmoid; 2 * s moved right and merged with s * 2; x.add(1) and torch.add(x, 1) one
    # node: adds s2 + s2, + (x + 1), and x + 1 itself
    assert targets.count(torch.sigmoid) == 1 and targets.count(operator.mul) == 1
    assert targets.count(operator.add) == 3
    x = torch.randn(9, dtype=torch.float64)
    want = torch.sigmoid(x) * 4.0
    torch.testing.assert_close(gm(x), want)


def test_clamp_and_comparisons_normalised():
    got, _ = ops_of(lambda x: x.clamp(-1.0, 2.0) + torch.clip(x, min=-1.0, max=2.0) +
                    x.gt(0.5) * 1.0)
    assert got[0] == (torch.clamp, ("x", -1.0, 2.0))
    assert [t for t, _ in got].count(torch.clamp) == 1
    assert (operator.gt, ("x", 0.5)) in got


def test_in_place_graphs_are_left_alone():
    def f(x):
        y = x * x
        y.mul_(2.0)
        return y
    got, _ = ops_of(f)
    assert got[0][0] is operator.mul


def test_errors_still_quote_what_the_user_wrote():
    with pytest.raises(DSLError, match=r"\* \(mul\) at .*state \* state.*multiplies or "
                                       r"divides two state-dependent"):
        dsl.variant("q", chunk_mode=builtins._la_chunk,
                    decay_mode=lambda state, chunk_state: state * state + chunk_state,
                    merge_mode=builtins._la_merge, inputs=("q", "k", "v"))


# -- prologue DAGs ---------------------------------------------------------------------------
def _dag_of(f):
    def program(x):
        y = f(x)
        return y @ y.transpose(-1, -2)
    return lowering._dag([canonicalise(fx.symbolic_trace(program))], "x")


def test_dag_prologue_extraction():
    # x * sigmoid(x): a DAG, its value the product
    dag = _dag_of(lambda x: x * torch.sigmoid(x))
    assert [lowering._op_text(n) for n in dag[1:]] == ["sigmoid", "mul"]
    # the input is also used raw: no prologue is closed off
    gm = canonicalise(fx.symbolic_trace(lambda x: F.relu(x) @ x.transpose(-1, -2)))
    assert len(lowering._dag([gm], "x")) == 1
    gm = canonicalise(fx.symbolic_trace(
        lambda x: torch.where(x > 0, x, 0.1 * x) @ torch.exp(x).transpose(-1, -2)))
    assert len(lowering._dag([gm], "x")) == 1  # two values leave the DAG: none is the map


@pytest.mark.parametrize("name,f", [
    ("silu by hand", lambda x: x * torch.sigmoid(x)),
    ("leaky where", lambda x: torch.where(x > 0, x, 0.1 * x)),
    ("clamp times x", lambda x: torch.clamp(x, -1.0, 2.0) * x),
    ("cube", lambda x: x ** 3 - x),
    ("log sigmoid by hand", lambda x: torch.log(torch.sigmoid(x))),
    ("rsqrt reciprocal", lambda x: torch.rsqrt(x * x + 1.0) + 1.0 / (x * x + 2.0)),
])
def test_dag_maps_and_derivatives_as_triton(name, f):
    """Forward and reverse-mode derivative of DAG prologues, run as Triton (the
    interpreter on the CPU) against PyTorch in fp64."""
    pytest.importorskip("triton")
    from forge_dist import kernels
    from forge_dist.dsl import codegen
    from forge_dist.kernels.prologue import apply_map

    if not kernels.HAVE_TRITON or (not torch.cuda.is_available() and
                                   not kernels.interpreting()):
        pytest.skip("needs triton on CUDA or TRITON_INTERPRET=1")
    gm = canonicalise(fx.symbolic_trace(f))
    dag = [n for n in gm.graph.nodes if n.op != "output"]
    fmap, fgrad = codegen.triton_map(dag), codegen.triton_map_grad(dag)
    assert fmap is not None and fgrad is not None, name
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(300, generator=gen) * 2).to(dev).requires_grad_()
    y = apply_map(x, fmap[0], fgrad[0])
    dy = torch.randn(300, generator=gen).to(dev)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_()
    want = f(xd)
    (want_dx,) = torch.autograd.grad(want, xd, dy.double())
    torch.testing.assert_close(y.double(), want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(dx.double(), want_dx, rtol=2e-5, atol=2e-5)


# -- roles -----------------------------------------------------------------------------------
def test_roles_found_where_structure_misleads():
    """q read by chunk_mode too (an unused-looking extra read) and names that say nothing:
    the structural guess is off, the search over the dims' assignments still lowers."""
    def chunk(a, b, c, d):
        return builtins._sg_chunk(b, c, d) + 0.0 * a.sum() * 0  # reads a (the query)

    def decay(state, chunk_state, d):
        return builtins._sg_decay(state, chunk_state, d)

    def merge(state, a, b, c, d, scale):
        return builtins._sg_merge(state, a, b, c, d, scale)
    v = dsl.variant("anon", chunk_mode=chunk, decay_mode=decay, merge_mode=merge,
                    inputs={"a": "K", "b": "K", "c": "V", "d": ""})
    assert v.lowering is not None and v.lowering.roles == {"q": "a", "k": "b", "v": "c",
                                                          "g": "d"}
    assert "roles q=a, k=b, v=c, g=d" in v.describe()


def test_role_candidates_ordered_by_reads():
    v = dsl.variant("named", chunk_mode=builtins._gdn_chunk, decay_mode=builtins._gdn_decay,
                    merge_mode=builtins._gdn_merge,
                    inputs={"k": "K", "q": "K", "v": "V", "beta": "", "g": ""}, lower=False)
    cands, reason = roles.assignments("gated_delta_rule", v)
    assert not reason and len(cands) == 4
    assert cands[0] == {"q": "q", "k": "k", "v": "v", "g": "g", "beta": "beta"}
    cands, reason = roles.assignments("gla", v)
    assert not cands and "trailing dims" in reason

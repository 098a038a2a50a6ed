"""The prologue codegen: every translated op against PyTorch, run as Triton (the interpreter
on a CPU machine, compiled on a GPU one); what has no translation; one function per source."""
import operator
import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from forge_dist.dsl import codegen  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)


@triton.jit
def _apply(x, y, N, MAP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    b = tl.load(x + o, mask=o < N, other=0.0)
    tl.store(y + o, MAP(b), mask=o < N)


def chain(f):
    """The fx chain ``[placeholder, op, ...]`` of a one-argument elementwise function."""
    gm = fx.symbolic_trace(f)
    return [n for n in gm.graph.nodes if n.op != "output"]


CASES = {
    "relu": lambda x: torch.relu(x),
    "F.relu": lambda x: F.relu(x),
    "elu+1": lambda x: F.elu(x) + 1.0,
    "elu alpha": lambda x: F.elu(x, alpha=0.5),
    "elu alpha positional": lambda x: F.elu(x, 0.3),
    "sigmoid": lambda x: torch.sigmoid(x),
    "method sigmoid": lambda x: x.sigmoid(),
    "exp": lambda x: torch.exp(x * 0.5),
    "tanh": lambda x: torch.tanh(x),
    "abs neg": lambda x: torch.neg(torch.abs(x)),
    "square": lambda x: torch.square(x),
    "sqrt": lambda x: torch.sqrt(torch.abs(x) + 1e-3),
    "silu": lambda x: F.silu(x),
    "softplus": lambda x: F.softplus(x),
    "softplus beta threshold": lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    "logsigmoid": lambda x: F.logsigmoid(x),
    "gelu": lambda x: F.gelu(x),
    "gelu tanh": lambda x: F.gelu(x, approximate="tanh"),
    "constants on both sides": lambda x: 2.0 - (3.0 / (x * x + 1.0)) * 0.5,
    "expm1": lambda x: torch.expm1(x * 0.1),
    # scaled back up, so that the tolerance is relative to the small value (the plain forms
    # exp(a) - 1 and log(1 + a) would miss it by 1e-3 at a = 1e-4)
    "expm1 near 0": lambda x: torch.expm1(x * 3e-4) * 1e3,
    "log1p": lambda x: torch.log1p(torch.abs(x) * 0.01),
    "log1p near 0": lambda x: torch.log1p(x * 3e-4) * 1e3,
    "torch.add/mul/sub": lambda x: torch.sub(torch.mul(torch.add(x, 1.0), 2.0), 0.25),
}


@pytest.mark.parametrize("name", list(CASES))
def test_translated_ops_match_pytorch(name):
    f = CASES[name]
    got = codegen.triton_map(chain(f))
    assert got is not None, name
    fn, text = got
    assert text.startswith("def forge_prologue_")
    x = torch.cat([torch.linspace(-30, 30, 61), torch.randn(67, generator=torch.Generator()
                                                               .manual_seed(0)) * 3])
    x = x.to(DEV, torch.float32)
    y = torch.empty_like(x)
    _apply[(1,)](x, y, x.numel(), MAP=fn, BLOCK=triton.next_power_of_2(x.numel()))
    want = f(x.double()).float()
    torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5)


@triton.jit
def _apply_grad(x, dy, dx, N, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    b = tl.load(x + o, mask=o < N, other=0.0)
    d = tl.load(dy + o, mask=o < N, other=0.0)
    tl.store(dx + o, GRAD(b, d), mask=o < N)


@pytest.mark.parametrize("name", list(CASES) + ["x * x", "x + x", "x - x"])
def test_translated_gradients_match_autograd(name):
    """The generated vector-Jacobian product of every chain against PyTorch's autograd in
    fp64 (its conventions at the kinks: relu' and abs' are 0 at 0, elu' is alpha there)."""
    f = {"x * x": lambda x: x * x, "x + x": lambda x: (x + x) * 0.5,
         "x - x": lambda x: (x - x) + 1.0}.get(name) or CASES[name]
    got = codegen.triton_map_grad(chain(f))
    assert got is not None, name
    fn, text = got
    assert text.startswith("def forge_prologue_grad_")
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.linspace(-30, 30, 61), torch.randn(67, generator=gen) * 3])
    dy = torch.randn(x.numel(), generator=gen)
    xd = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(f(xd), xd, dy.double())
    x, dy = x.to(DEV), dy.to(DEV)
    dx = torch.empty_like(x)
    _apply_grad[(1,)](x, dy, dx, x.numel(), GRAD=fn, BLOCK=triton.next_power_of_2(x.numel()))
    torch.testing.assert_close(dx.cpu(), want.float(), rtol=2e-5, atol=2e-5)


def test_untranslatable_chains_give_none():
    assert codegen.triton_map(chain(lambda x: x)) is None  # identity: nothing to fuse
    assert codegen.triton_map(chain(lambda x: torch.add(x, 1.0, alpha=2.0))) is None
    g = fx.Graph()  # an op outside the table (the lowering never extracts one, but say so)
    x = g.placeholder("x")
    n = g.call_function(torch.erf, (x,))
    assert codegen.triton_map([x, n]) is None
    assert codegen.triton_map_grad([x, n]) is None
    assert codegen.triton_map_grad(chain(lambda x: x)) is None
    g = fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(F.softplus, (x,), {"beta": "two"})
    assert codegen.triton_map([x, n]) is None
    assert codegen.triton_map_grad([x, n]) is None
    assert codegen.triton_map_grad(chain(lambda x: x)) is None


def test_one_function_per_source():
    a = codegen.triton_map(chain(lambda x: F.elu(x) + 1.0))
    b = codegen.triton_map(chain(lambda y: F.elu(y) + 1.0))
    c = codegen.triton_map(chain(lambda x: F.elu(x) + 2.0))
    assert a[0] is b[0] and a[1] == b[1]  # the kernels' compile caches see one constexpr
    assert c[0] is not a[0]
    assert operator.contains(a[1], "tl.exp")


def _rg_lru_input(x, i, r, lam):  # RG-LRU's scaled input: a map of four inputs
    log_a = -8.0 * F.softplus(-lam) * torch.sigmoid(r)
    return torch.sqrt(-torch.expm1(2.0 * log_a)) * (torch.sigmoid(i) * x)


@pytest.mark.parametrize("f", [lambda a, b: F.logsigmoid(a) + F.logsigmoid(b),
                               lambda a, b, c: a * torch.sigmoid(b) - c * c,
                               _rg_lru_input], ids=["two", "three", "rg_lru"])
def test_maps_of_several_inputs_and_their_gradients(f):
    """A shared role's map of several inputs (``x0, x1, ...``) as one generated kernel
    (kernels.prologue: ElementwisePrologue over inputs of one shape, bf16 and fp32 mixed:
    the result in their promoted dtype) and its generated gradient for every input, against
    PyTorch in fp64."""
    from forge_dist.kernels.prologue import ElementwisePrologue

    nodes = chain(f)
    fmap, fgrad = codegen.triton_map(nodes), codegen.triton_map_grad(nodes)
    assert fmap is not None and fgrad is not None
    k = len([n for n in nodes if n.op == "placeholder"])
    assert fmap[1].startswith(f"def forge_prologue_") and f"x{k - 1}" in fmap[1]
    pro = ElementwisePrologue(fmap[0], fgrad[0], f, lambda device: True)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 37, generator=gen) + (2.0 if j == k - 1 else 0.0) for j in range(k)]
    ins = [x.to(DEV, torch.bfloat16 if j == 0 else torch.float32).requires_grad_()
           for j, x in enumerate(xs)]
    y = pro(*ins)
    assert y.dtype == torch.float32 and y.shape == xs[0].shape
    ref = [x.to(DEV, torch.bfloat16 if j == 0 else torch.float32).double().requires_grad_()
           for j, x in enumerate(xs)]
    want = f(*ref)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(want.shape, generator=gen).to(DEV)
    got = torch.autograd.grad(y, ins, dy)
    exp = torch.autograd.grad(want, ref, dy.double())
    for j, (a, b) in enumerate(zip(got, exp)):
        assert a.dtype == ins[j].dtype
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("D", [16, 96])
def test_a_per_head_scalar_broadcast_in_one_map(D):
    """``k * sigmoid(i)[..., None]`` (an input gate: ``i [B, T, H]`` onto ``k [B, T, H,
    D]``) as one generated kernel that loads ``i`` once per element of ``k`` (the
    ``[..., None]`` is the identity there), the result written in the dtype asked for, and
    ``i``'s gradient summed over ``D``, against PyTorch in fp64."""
    from forge_dist.kernels.prologue import ElementwisePrologue

    def f(k, i):
        return k * torch.sigmoid(i)[..., None] - 0.5 * i[..., None]
    nodes = chain(f)
    fmap, fgrad = codegen.triton_map(nodes), codegen.triton_map_grad(nodes)
    pro = ElementwisePrologue(fmap[0], fgrad[0], f, lambda device: True)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 21, 3, D, generator=gen).to(DEV, torch.bfloat16).requires_grad_()
    i = torch.randn(2, 21, 3, generator=gen).to(DEV).requires_grad_()
    y = pro(k, i, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == k.shape
    assert pro(k, i).dtype == torch.float32  # promoted, by default
    kd, idd = (t.detach().double().requires_grad_() for t in (k, i))
    want = f(kd, idd)
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)
    dy = torch.randn(k.shape, generator=gen).to(DEV, torch.bfloat16)
    dk, di = torch.autograd.grad(y, (k, i), dy)
    wk, wi = torch.autograd.grad(want, (kd, idd), dy.double())
    assert dk.dtype == torch.bfloat16 and di.dtype == torch.float32 and di.shape == i.shape
    torch.testing.assert_close(dk.double(), wk, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(di.double(), wi, rtol=1e-5, atol=1e-4)
    # inputs of shapes that are neither the output's nor its per-head scalars: PyTorch
    calls = []
    slow = ElementwisePrologue(fmap[0], fgrad[0], lambda *xs: calls.append(1) or f(*xs),
                               lambda device: True)
    slow(k.detach()[:, :, :1], i.detach())
    assert calls == [1]

"""Triton code for a lowered variant's elementwise prologues.

A prologue is the chain of elementwise ops the lowering found on one input (``elu(q) + 1``,
``logsigmoid(g)``, ...; see :mod:`.lowering`).  :func:`triton_map` writes it as a
``@triton.jit`` function of one tile, which the templates take as a constexpr argument
(``Q_MAP``, ``K_MAP``, ``V_MAP``, ``G_MAP``; ``X_MAP`` for hgrn) and apply to every tile of
that input they load: the map runs in registers on the way in, with no pass over the tensor
before the kernels and no mapped copy in memory.

The function computes in fp32 and returns fp32; the template rounds q, k, v to the operand
dtype after it (as the PyTorch prologue's result is cast) and keeps gates in fp32, and zeroes
what it loaded as padding (``f(0)`` need not be 0).  Each op maps to ``tl`` arithmetic, so
the map also runs under ``TRITON_INTERPRET=1``.  Ops or arguments without a translation
give ``None``: the lowering then runs that prologue in PyTorch and says so.

Generated sources are registered with :mod:`linecache` under a name derived from their text
(``inspect.getsource``, which Triton's JIT reads, finds them there), and one function is kept
per source, so the kernels' compile caches see the same constexpr for the same prologue.
"""
from __future__ import annotations

import hashlib
import linecache
import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

_FUNCTIONS: Dict[str, object] = {}  # source hash -> jitted map (one per distinct prologue)


def _num(x) -> Optional[str]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return repr(float(x))


# parameters of the ops that take any, with PyTorch's defaults, in positional order
_PARAMS = {"elu": (("alpha", 1.0),), "softplus": (("beta", 1.0), ("threshold", 20.0)),
           "gelu": (("approximate", "none"),)}


def _params(name: str, args, kwargs: dict) -> Optional[Dict[str, str]]:
    """The op's parameters as code (numbers as float literals, gelu's ``approximate`` as
    given) from its extra positional ``args`` and ``kwargs``, or ``None`` for any argument
    the translation does not cover."""
    spec = _PARAMS.get(name, ())
    kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    if len(args) > len(spec):
        return None
    kwargs.update((pname, value) for (pname, _), value in zip(spec, args))
    out = {}
    for pname, default in spec:
        value = kwargs.pop(pname, default)
        if pname == "approximate":
            if value not in ("none", "tanh"):
                return None
            out[pname] = value
        else:
            out[pname] = _num(value)
            if out[pname] is None:
                return None
    return None if kwargs else out


def _unary(name: str, a: str, p: Dict[str, str]) -> Optional[str]:
    """``tl`` expression of the unary op ``name`` (parameters ``p``) on the fp32 value ``a``."""
    if name == "relu":
        return f"tl.maximum({a}, 0.0)"
    if name == "elu":
        return f"tl.where({a} > 0.0, {a}, {p['alpha']} * (tl.exp({a}) - 1.0))"
    if name == "softplus":
        beta, threshold = p["beta"], p["threshold"]
        # PyTorch's: linear once beta * x passes the threshold
        return (f"tl.where({a} * {beta} > {threshold}, {a}, "
                f"tl.log(1.0 + tl.exp(tl.minimum({a} * {beta}, {threshold}))) / {beta})")
    if name == "gelu":
        if p["approximate"] == "none":
            return f"0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))"
        inner = f"0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})"
        return f"{a} * tl.sigmoid(2.0 * ({inner}))"  # 0.5 (1 + tanh u) = sigmoid(2u)
    return {
        "sigmoid": f"tl.sigmoid({a})",
        "exp": f"tl.exp({a})",
        "tanh": f"2.0 * tl.sigmoid(2.0 * {a}) - 1.0",
        "abs": f"tl.abs({a})",
        "neg": f"-{a}",
        "sqrt": f"tl.sqrt({a})",
        "square": f"{a} * {a}",
        "silu": f"{a} * tl.sigmoid({a})",
        # log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|)), stable at both ends
        "logsigmoid": f"tl.minimum({a}, 0.0) - tl.log(1.0 + tl.exp(-tl.abs({a})))",
    }.get(name)


_FUNC_NAMES = {torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid", torch.exp: "exp",
               torch.tanh: "tanh", torch.abs: "abs", torch.neg: "neg", F.elu: "elu",
               F.silu: "silu", F.softplus: "softplus", F.logsigmoid: "logsigmoid",
               F.gelu: "gelu", torch.sqrt: "sqrt", torch.square: "square"}
_METHOD_NAMES = {"relu", "sigmoid", "exp", "tanh", "abs", "neg", "sqrt", "square"}
_ARITH = {operator.add: "+", torch.add: "+", operator.sub: "-", torch.sub: "-",
          operator.mul: "*", torch.mul: "*", operator.truediv: "/"}


def _op(n: fx.Node, src: fx.Node) -> Optional[Tuple[str, Dict[str, str]]]:
    """``(op name, parameters)`` of a unary chain node applied to ``src``, or ``None``."""
    if n.op == "call_method":
        ok = n.target in _METHOD_NAMES and len(n.args) == 1 and n.args[0] is src
        name, extra = (n.target, ()) if ok else (None, ())
    elif n.op == "call_function" and n.args and n.args[0] is src:
        name, extra = _FUNC_NAMES.get(n.target), n.args[1:]
    else:
        name = None
    if name is None:
        return None
    p = _params(name, extra, dict(n.kwargs))
    return None if p is None else (name, p)


def _arith(n: fx.Node, src: fx.Node, a: str) -> Optional[Tuple[str, List[Optional[str]]]]:
    """``(operator, [operand code, operand code])`` of arithmetic with constants (``a`` for
    ``src``), or ``None``."""
    if n.op != "call_function" or n.target not in _ARITH or n.kwargs or len(n.args) != 2:
        return None  # e.g. torch.add(x, c, alpha=...)
    ops = [a if x is src else _num(x) for x in n.args]
    return None if None in ops else (_ARITH[n.target], ops)


def _expr(n: fx.Node, src: fx.Node, a: str) -> Optional[str]:
    """The expression of chain node ``n`` whose tensor operand ``src`` is held in ``a``."""
    arith = _arith(n, src, a)
    if arith is not None:
        op, (x, y) = arith
        return f"({x} {op} {y})"
    got = _op(n, src)
    return None if got is None else _unary(got[0], a, got[1])


def source(chain: List[fx.Node]) -> Optional[str]:
    """The body lines of the map of ``chain`` (``[input placeholder, op, op, ...]``), or
    ``None`` when an op has no translation."""
    lines, var = [], "x"
    for i, n in enumerate(chain[1:]):
        e = _expr(n, chain[i], var)
        if e is None:
            return None
        var = f"v{i}"
        lines.append(f"    {var} = {e}")
    return "\n".join(lines + [f"    return {var}"])


def _unary_grad(name: str, a: str, y: str, p: Dict[str, str]) -> Optional[str]:
    """``d y / d a`` of the unary op ``name`` (parameters ``p``; ``y`` its value at ``a``),
    PyTorch's derivatives (relu' and abs' are 0 at 0, softplus' is 1 past its threshold)."""
    if name == "elu":
        return f"tl.where({a} > 0.0, 1.0, {p['alpha']} * tl.exp({a}))"
    if name == "softplus":
        beta, threshold = p["beta"], p["threshold"]
        return f"tl.where({a} * {beta} > {threshold}, 1.0, tl.sigmoid({a} * {beta}))"
    if name == "gelu":
        if p["approximate"] == "none":  # Phi(a) + a phi(a)
            return (f"(0.5 * (1.0 + tl.erf({a} * 0.7071067811865476)) + "
                    f"{a} * 0.3989422804014327 * tl.exp(-0.5 * {a} * {a}))")
        u = f"0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})"
        t = f"(2.0 * tl.sigmoid(2.0 * ({u})) - 1.0)"  # tanh(u)
        return (f"(0.5 * (1.0 + {t}) + 0.5 * {a} * (1.0 - {t} * {t}) * 0.7978845608028654 "
                f"* (1.0 + 0.134145 * {a} * {a}))")
    return {
        "relu": f"tl.where({a} > 0.0, 1.0, 0.0)",
        "sigmoid": f"{y} * (1.0 - {y})",
        "exp": y,
        "tanh": f"(1.0 - {y} * {y})",
        "abs": f"tl.where({a} > 0.0, 1.0, tl.where({a} < 0.0, -1.0, 0.0))",
        "neg": "-1.0",
        "sqrt": f"0.5 / {y}",
        "square": f"2.0 * {a}",
        "silu": f"tl.sigmoid({a}) * (1.0 + {a} * (1.0 - tl.sigmoid({a})))",
        "logsigmoid": f"tl.sigmoid(-{a})",
    }.get(name)


def _grad_expr(n: fx.Node, src: fx.Node, a: str, y: str) -> Optional[str]:
    """``d n / d src`` for chain node ``n`` (its operand held in ``a``, its value in ``y``);
    the same cases as :func:`_expr`."""
    arith = _arith(n, src, a)
    if arith is not None:
        op, (first, second) = arith
        if first == a and second == a:  # x + x, x - x, x * x, x / x
            return {"+": "2.0", "-": "0.0", "*": f"2.0 * {a}", "/": "0.0"}[op]
        const = second if first == a else first
        if op == "+":
            return "1.0"
        if op == "-":
            return "1.0" if first == a else "-1.0"
        if op == "*":
            return const
        # division: a / c or c / a
        return f"(1.0 / {const})" if first == a else f"(-{const} / ({a} * {a}))"
    got = _op(n, src)
    return None if got is None else _unary_grad(got[0], a, y, got[1])


def grad_source(chain: List[fx.Node]) -> Optional[str]:
    """Body lines of the chain's vector-Jacobian product ``dy * f'(x)`` (the forward values
    recomputed in registers, then the chain rule op by op), or ``None``."""
    lines, factors, var = [], [], "x"
    for i, n in enumerate(chain[1:]):
        e, d = _expr(n, chain[i], var), _grad_expr(n, chain[i], var, f"v{i}")
        if e is None or d is None:
            return None
        lines.append(f"    v{i} = {e}")
        factors.append(d)
        var = f"v{i}"
    lines.append("    d = dy.to(tl.float32)")
    lines += [f"    d = d * ({f})" for f in reversed(factors)]
    return "\n".join(lines + ["    return d"])


def _jit(kind: str, args: str, body: str) -> Tuple[Callable, str]:
    """The jitted function ``forge_<kind>_<hash>(<args>)`` of ``body`` (one per source)."""
    import triton
    import triton.language as tl

    digest = hashlib.sha256(f"{kind}({args})\n{body}".encode()).hexdigest()[:16]
    name = f"forge_{kind}_{digest}"
    first = args.split(",")[0]
    text = f"def {name}({args}):\n    {first} = {first}.to(tl.float32)\n{body}\n"
    fn = _FUNCTIONS.get(digest)
    if fn is None:
        filename = f"<forge_dist.dsl {kind} {digest}>"
        # inspect.getsource (Triton's JIT reads the source) finds it in linecache
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        namespace = {"tl": tl}
        exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - our own generated text
        fn = _FUNCTIONS[digest] = triton.jit(namespace[name])
    return fn, text


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # no kernels to run the maps
        return False
    return True


def triton_map(chain: List[fx.Node]) -> Optional[Tuple[Callable, str]]:
    """``(jitted map, its source)`` for an elementwise chain, or ``None`` (identity chains
    and untranslatable ops).  The map takes and returns an fp32 tile."""
    if len(chain) < 2:
        return None
    body = source(chain)
    if body is None or not _have_triton():
        return None
    return _jit("prologue", "x", body)


def triton_map_grad(chain: List[fx.Node]) -> Optional[Tuple[Callable, str]]:
    """``(jitted vector-Jacobian product, its source)`` of the chain: ``f(x, dy)`` returns
    ``dy * chain'(x)`` in fp32; ``None`` where :func:`triton_map` gives ``None``."""
    if len(chain) < 2:
        return None
    body = grad_source(chain)
    if body is None or not _have_triton():
        return None
    return _jit("prologue_grad", "x, dy", body)

"""Canonical forms of the traced graphs, so that one computation written several ways is one
graph (the lowering then matches and generates code for what it means, not how it is spelt).

Run on every phase right after tracing (:func:`forge_dist.dsl.trace.trace_phase`); every
rewrite keeps the values (and the gradients, up to measure-zero kinks), so the executor, the
analysis and the lowering all see the same program:

* one spelling per elementwise op: ``x.relu()``, ``F.relu(x)`` -> ``torch.relu(x)``;
  ``torch.add / sub / mul / div``, ``x.add(y)`` ... -> ``operator.add`` ...; ``torch.pow``,
  ``x.pow`` -> ``x ** n``; ``x.clamp`` -> ``torch.clamp(x, lo, hi)``; ``x.gt(0)`` -> ``x > 0``;
* squares and integer powers: ``x * x`` (also over a repeated subexpression once it is one
  node, ``F.relu(x) * F.relu(x)``), ``x ** 2``, ``torch.square(x)`` -> ``torch.square(x)``;
  ``x ** n`` for an integer ``3 <= n <= 8`` -> products of squares; ``x ** 1`` -> ``x``,
  ``x ** 0.5`` -> ``sqrt``, ``x ** -1`` -> ``1 / x``, ``x ** -0.5`` -> ``rsqrt``;
* folds: ``clamp(x, min=0)`` and ``torch.where(x > 0, x, 0)`` -> ``relu(x)``; a constant on
  the left of ``+`` / ``*`` moves right (``x * 1`` stays: it turns a boolean mask into
  numbers, and the graphs carry no dtypes here);
* common subexpressions: two nodes with the same op and operands become one.

Graphs with in-place operations are left as they are (the analysis rejects them anyway).  A
rewritten node keeps the user line and op name it came from (``meta["dsl_source"]`` /
``meta["dsl_op"]``), so errors still quote what the user wrote.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

# method name -> canonical function for elementwise methods (one tensor operand: self)
_UNARY_METHODS = {"relu": torch.relu, "sigmoid": torch.sigmoid, "exp": torch.exp,
                  "tanh": torch.tanh, "abs": torch.abs, "sqrt": torch.sqrt,
                  "square": torch.square, "log": torch.log, "rsqrt": torch.rsqrt,
                  "reciprocal": torch.reciprocal, "neg": operator.neg, "expm1": torch.expm1,
                  "log1p": torch.log1p}
_BINARY_METHODS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                   "div": operator.truediv, "pow": operator.pow, "gt": operator.gt,
                   "ge": operator.ge, "lt": operator.lt, "le": operator.le,
                   "__add__": operator.add, "__mul__": operator.mul}
_FUNCTIONS = {F.relu: torch.relu, torch.neg: operator.neg, torch.add: operator.add,
              torch.sub: operator.sub, torch.mul: operator.mul, torch.div: operator.truediv,
              torch.true_divide: operator.truediv, torch.pow: operator.pow,
              torch.gt: operator.gt, torch.ge: operator.ge, torch.lt: operator.lt,
              torch.le: operator.le, torch.clip: torch.clamp}
_COMMUTATIVE = {operator.add, operator.mul}
# ops whose value depends on more than their operands (never merged)
_IMPURE_NAMES = {"rand", "randn", "rand_like", "randn_like", "dropout", "bernoulli",
                 "multinomial", "normal", "randint", "randperm"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mutates(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("__")
    return n.op == "call_function" and n.target in (operator.setitem, operator.iadd,
                                                    operator.isub, operator.imul,
                                                    operator.itruediv)


def _impure(n: fx.Node) -> bool:
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return name in _IMPURE_NAMES


def _freeze(x):
    """A hashable image of a node argument (nodes by identity)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_freeze(a) for a in x)
    if isinstance(x, slice):
        return ("slice", _freeze(x.start), _freeze(x.stop), _freeze(x.step))
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, float):
        return ("float", x)  # 2.0 and 2 stay apart (they can give different dtypes)
    return x


class _Canon:
    def __init__(self, gm: fx.GraphModule):
        self.g = gm.graph
        self.seen: Dict[object, fx.Node] = {}

    # -- building ----------------------------------------------------------------------------
    def make(self, like: fx.Node, target: Callable, args, kwargs=None) -> fx.Node:
        """A new canonical ``call_function`` node before ``like`` (itself canonicalised:
        merged with an equal node if there is one)."""
        with self.g.inserting_before(like):
            n = self.g.call_function(target, tuple(args), kwargs or {})
        n.meta.update({k: v for k, v in like.meta.items() if k in ("dsl_source", "dsl_op")})
        return self.visit(n)

    def replace(self, n: fx.Node, by: fx.Node) -> fx.Node:
        if by is not n:
            n.replace_all_uses_with(by)
            self.g.erase_node(n)
        return by

    # -- one node ----------------------------------------------------------------------------
    def visit(self, n: fx.Node) -> fx.Node:
        if n.op not in ("call_function", "call_method"):
            return n
        if "dsl_op" not in n.meta:
            from .trace import op_name  # lazy: dsl.trace imports this module

            n.meta["dsl_op"] = op_name(n)
        new = self.rewrite(n)
        if new is not None:
            return self.replace(n, new)
        if _impure(n):
            return n
        try:
            key = (n.op, n.target, _freeze(n.args), _freeze(n.kwargs))
            hash(key)
        except TypeError:
            return n
        if key in self.seen:
            return self.replace(n, self.seen[key])
        self.seen[key] = n
        return n

    def rewrite(self, n: fx.Node) -> Optional[fx.Node]:
        """The canonical node computing ``n`` (``None``: ``n`` is canonical already)."""
        a, kw, t = n.args, dict(n.kwargs), n.target
        if n.op == "call_method":
            if t in _UNARY_METHODS and len(a) == 1 and not kw:
                return self.make(n, _UNARY_METHODS[t], a)
            if t in _BINARY_METHODS and len(a) == 2 and not kw:
                return self.make(n, _BINARY_METHODS[t], a)
            if t in ("clamp", "clip", "clamp_min") and len(a) >= 1:
                return self.clamp(n, a, kw, t == "clamp_min")
            return None
        if t in (torch.clamp, torch.clip, torch.clamp_min):
            return self.clamp(n, a, kw, t is torch.clamp_min)
        if t is F.relu and not kw.get("inplace", False) and len(a) == 1:
            return self.make(n, torch.relu, a)
        if t in _FUNCTIONS and t is not F.relu and not kw and len(a) in (1, 2):
            return self.make(n, _FUNCTIONS[t], a)
        if t in _COMMUTATIVE and len(a) == 2 and _number(a[0]) and isinstance(a[1], fx.Node):
            return self.make(n, t, (a[1], a[0]))
        if t is operator.mul and len(a) == 2 and isinstance(a[0], fx.Node) and a[0] is a[1]:
            return self.make(n, torch.square, (a[0],))
        if t is operator.pow and len(a) == 2 and isinstance(a[0], fx.Node) and _number(a[1]):
            return self.power(n, a[0], a[1])
        if t is torch.where and len(a) == 3 and not kw:
            return self.where_relu(n, *a)
        return None

    def power(self, n: fx.Node, x: fx.Node, p) -> Optional[fx.Node]:
        if p == 1:
            return x
        if p == 2:
            return self.make(n, torch.square, (x,))
        if p == 0.5:
            return self.make(n, torch.sqrt, (x,))
        if p == -1:
            return self.make(n, operator.truediv, (1.0, x))
        if p == -0.5:
            return self.make(n, torch.rsqrt, (x,))
        if float(p).is_integer() and 3 <= p <= 8:  # square-and-multiply
            p, result, base = int(p), None, x
            while p:
                if p & 1:
                    result = base if result is None else self.make(n, operator.mul,
                                                                   (result, base))
                p >>= 1
                if p:
                    base = self.make(n, torch.square, (base,))
            return result
        return None

    def clamp(self, n: fx.Node, a, kw, min_only: bool) -> Optional[fx.Node]:
        x = a[0]
        rest = list(a[1:])
        lo = kw.pop("min") if "min" in kw else (rest.pop(0) if rest else None)
        hi = None
        if not min_only:
            hi = kw.pop("max") if "max" in kw else (rest.pop(0) if rest else None)
        if kw or rest or not isinstance(x, fx.Node) or not all(
                v is None or _number(v) for v in (lo, hi)):
            return None
        if lo is not None and lo == 0 and hi is None:
            return self.make(n, torch.relu, (x,))
        if n.op == "call_function" and n.target is torch.clamp and list(n.args) == [x, lo, hi]:
            return None  # canonical already
        return self.make(n, torch.clamp, (x, lo, hi))

    def where_relu(self, n: fx.Node, cond, x, other) -> Optional[fx.Node]:
        """``torch.where(x > 0, x, 0)`` (or ``>=``) is ``relu(x)``."""
        if isinstance(cond, fx.Node) and cond.op == "call_function" and \
                cond.target in (operator.gt, operator.ge) and cond.args[0] is x and \
                _number(cond.args[1]) and cond.args[1] == 0 and _number(other) and other == 0:
            return self.make(n, torch.relu, (x,))
        return None


def canonicalise(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gm``'s graph into its canonical form in place (see the module docstring);
    returns ``gm``."""
    g = gm.graph
    if any(_mutates(n) for n in g.nodes):
        return gm
    canon = _Canon(gm)
    for n in list(g.nodes):  # rewrites erase only the node visited and nodes they made
        canon.visit(n)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return gm

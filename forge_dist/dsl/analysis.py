"""Checks on the traced graphs: affinity in the state, and the transition kind.

Walking ``decay_mode`` / ``merge_mode`` in order, every node is *free* (does not depend on the
``state`` parameter) or *state-dependent*.  A state-dependent node must be a linear map of
state-dependent operands, plus free offsets:

* ``x + b``, ``x - b``, ``b - x``, ``x + y``, ``-x``; ``x * a``, ``x / a``; ``a @ x``, ``x @ a``;
  sums / means over dims; casts (``.to``, ``.float()``, ...); views and indexing; ``tril``;
  ``torch.where(c, x, 0)``; ``einsum`` with one state operand;

anything else applied to the state (``exp``, ``relu``, ``x * y``, ``x @ y``, ``1 / x``, an MLP
as in TTT, ...) has no chunk-wise affine summary and is rejected, naming the op and line.

For ``decay_mode`` the walk also tracks where the state's K (row) and V (column) axes are, and
what has been done to the rows; the result is the transition kind:

=========  ===================================================================
identity   the state passes through unchanged (``state + chunk_state``)
scalar     rows scaled by a factor constant along K and V (``state * a[..., None, None]``)
diagonal   rows scaled by a factor varying along K (``state * a[..., :, None]``)
dense      rows mixed (``a @ state``, a sum over K ...): ``M`` is a K x K matrix
=========  ===================================================================

Columns (V) must stay independent (every kind in :mod:`forge_dist.variants.transitions`
needs it): a factor varying along V, or a product contracting V, is rejected.  A vector state
(``[B, NT, D]``) allows identity, scalar and diagonal only.
"""
from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx

from ..variants.transitions import Kind
from .trace import DSLError, Phase, op_name, shape_text, where

_ORDER = {Kind.IDENTITY: 0, Kind.SCALAR: 1, Kind.DIAGONAL: 2, Kind.DENSE: 3}


def widest(*kinds: Kind) -> Kind:
    return max(kinds, key=_ORDER.__getitem__)


def _category(n: fx.Node) -> str:
    t = n.target
    if n.op == "call_method":
        if t.endswith("_") and not t.startswith("__"):
            return "inplace"
        return {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg",
                "matmul": "matmul", "bmm": "matmul", "to": "cast", "float": "cast",
                "double": "cast", "half": "cast", "bfloat16": "cast", "type_as": "cast",
                "contiguous": "cast", "clone": "cast", "sum": "sum", "mean": "sum",
                "transpose": "transpose", "swapaxes": "transpose", "t": "transpose",
                "permute": "permute", "unsqueeze": "unsqueeze", "expand": "expand",
                "expand_as": "expand", "tril": "mask", "triu": "mask",
                "masked_fill": "masked_fill", "reshape": "view", "view": "view",
                "flatten": "view", "squeeze": "view", "size": "meta", "dim": "meta",
                "item": "data", "tolist": "data", "numpy": "data"}.get(t, "other")
    if n.op == "call_function":
        table = {operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
                 operator.mul: "mul", torch.mul: "mul", operator.truediv: "div",
                 torch.div: "div", operator.neg: "neg", torch.neg: "neg", operator.pos: "cast",
                 operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul",
                 torch.sum: "sum", torch.mean: "sum", torch.transpose: "transpose",
                 torch.swapaxes: "transpose", torch.permute: "permute",
                 torch.unsqueeze: "unsqueeze", torch.tril: "mask", torch.triu: "mask",
                 torch.where: "where", torch.einsum: "einsum", torch.cat: "cat",
                 torch.stack: "cat", torch.reshape: "view", torch.flatten: "view",
                 torch.squeeze: "view", torch.clone: "cast", operator.getitem: "getitem",
                 builtins.getattr: "getattr", operator.setitem: "inplace",
                 operator.iadd: "inplace", operator.isub: "inplace", operator.imul: "inplace",
                 operator.itruediv: "inplace"}
        try:
            cat = table.get(t)
        except TypeError:
            cat = None
        if cat is not None:
            return cat
        name = getattr(t, "__name__", "")
        if name in ("rand", "randn", "rand_like", "randn_like", "dropout", "bernoulli",
                    "multinomial", "normal", "randint"):
            return "random"
        return "other"
    return n.op


@dataclass(frozen=True)
class Dep:
    """How a state-dependent value depends on the state (decay_mode tracking).

    ``vpos`` / ``kpos``: negative positions of the state's V and K axes in this value
    (``kpos=None`` once rows have been mixed; ``vpos=None`` for a vector state).
    """

    kind: Kind
    vpos: Optional[int]
    kpos: Optional[int]


@dataclass
class Affine:
    """Result of the affinity analysis of one phase."""

    kind: Optional[Kind]  # decay_mode: transition kind; merge_mode: None
    dependent: set  # names of state-dependent nodes
    linear: fx.GraphModule  # the linear part: free offsets dropped (same parameters)


def _norm(d: int, n: int) -> int:
    return d if d < 0 else d - n


def _dim_arg(n: fx.Node, index: int, key: str):
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(key)


class _Walk:
    def __init__(self, phase: Phase, state: str, track: bool, vector: bool):
        self.phase, self.track, self.vector = phase, track, vector
        self.dep: Dict[fx.Node, Optional[Dep]] = {}
        self.state = state

    # -- errors -------------------------------------------------------------------------------
    def reject(self, n: fx.Node, why: str):
        raise DSLError(f"{self.phase.name}: {op_name(n)} at {where(n)}: {why}")

    def nonaffine(self, n: fx.Node, why: str):
        self.reject(n, f"{why}; the state update is not affine in the state, so it has no "
                       f"chunk-wise (associative) summary (nonlinear updates such as TTT's MLP "
                       f"cannot be chunked or sequence-parallelised)")

    def layout(self, n: fx.Node, why: str):
        self.reject(n, f"{why} (decay_mode must keep the state's columns (V axis) independent "
                       f"and its layout [..., K, V] recognisable to classify the transition)")

    # -- helpers ------------------------------------------------------------------------------
    def is_dep(self, a) -> bool:
        return isinstance(a, fx.Node) and a in self.dep

    def ndim(self, a) -> int:
        if isinstance(a, fx.Node):
            s = self.phase.node_shape(a)
            return 0 if s is None else len(s)
        return 0

    def shape(self, a) -> Tuple[str, ...]:
        s = self.phase.node_shape(a) if isinstance(a, fx.Node) else ()
        return () if s is None else s

    def operands(self, n: fx.Node):
        return [a for a in list(n.args) + list(n.kwargs.values())]

    # -- the walk -----------------------------------------------------------------------------
    def run(self):
        for n in self.phase.gm.graph.nodes:
            if n.op == "placeholder":
                if n.target == self.state:
                    self.dep[n] = (Dep(Kind.IDENTITY, None, -1) if self.vector
                                   else Dep(Kind.IDENTITY, -1, -2))
                continue
            if n.op == "output":
                continue
            cat = _category(n)
            if cat == "inplace":
                self.reject(n, "in-place operations are not supported (write x = x + y)")
            if cat == "random":
                self.reject(n, "random operations are not supported (phases are re-run and "
                               "must be deterministic)")
            if cat == "data":
                self.reject(n, "reading tensor values into Python is not supported (the graph "
                               "must not depend on data)")
            flat = []
            fx.node.map_arg((n.args, n.kwargs), lambda a: flat.append(a))
            deps = [a for a in flat if a in self.dep]
            if not deps:
                continue
            if cat in ("getattr", "meta"):
                continue  # shape / dtype / device of the state: not its values
            self.dep[n] = self.transfer(n, cat, deps)

    def transfer(self, n: fx.Node, cat: str, deps) -> Optional[Dep]:
        """Check one state-dependent node; return its :class:`Dep` (``None`` when untracked)."""
        a = n.args
        track = self.track
        d0 = self.dep[deps[0]]
        if cat in ("add", "sub"):
            if "alpha" in n.kwargs:
                self.reject(n, "alpha= is not supported on state-dependent values")
            x, y = a[0], a[1]
            if self.is_dep(x) and self.is_dep(y):
                if not track:
                    return None
                dx, dy = self.dep[x], self.dep[y]
                if dx.vpos != dy.vpos:
                    self.layout(n, "adds two state terms whose V axes are in different places")
                kp = dx.kpos if dx.kpos == dy.kpos else None
                kind = widest(dx.kind, dy.kind, Kind.SCALAR)
                if kp is None and kind is not Kind.DENSE:
                    kind = self.to_dense(n, kind)
                return Dep(kind, dx.vpos, kp)
            dx = self.dep[x] if self.is_dep(x) else self.dep[y]
            if not track:
                return None
            if cat == "sub" and not self.is_dep(x):
                return Dep(widest(dx.kind, Kind.SCALAR), dx.vpos, dx.kpos)
            return dx
        if cat == "neg":
            return Dep(widest(d0.kind, Kind.SCALAR), d0.vpos, d0.kpos) if track else None
        if cat in ("mul", "div"):
            x, y = a[0], a[1]
            if self.is_dep(x) and self.is_dep(y):
                self.nonaffine(n, "multiplies or divides two state-dependent values")
            if cat == "div" and not self.is_dep(x):
                self.nonaffine(n, "divides by a state-dependent value")
            if "rounding_mode" in n.kwargs:
                self.nonaffine(n, "rounding division is not linear")
            if not track:
                return None
            dx = self.dep[x] if self.is_dep(x) else self.dep[y]
            factor = y if self.is_dep(x) else x
            return self.scaled(n, dx, self.shape(factor), self.ndim(n))
        if cat == "matmul":
            x, y = a[0], a[1]
            if self.is_dep(x) and self.is_dep(y):
                self.nonaffine(n, "multiplies two state-dependent matrices (quadratic in the "
                                  "state)")
            if not track:
                return None
            if self.vector:
                self.layout(n, "a vector state's transition must be elementwise; a matrix "
                               "product mixes its D axis")
            if self.ndim(x) < 2 or self.ndim(y) < 2:
                self.layout(n, "matrix-vector products on the state are not classified; "
                               "keep both operands at least 2-D")
            if self.is_dep(y):  # a @ x: contracts x's second-to-last axis
                dy = self.dep[y]
                if dy.vpos != -1:
                    self.layout(n, "contracts the state's V axis")
                return Dep(Kind.DENSE, -1, None)
            dx = self.dep[x]
            if dx.vpos != -2:
                self.layout(n, "right-multiplies the state, contracting its V axis")
            return Dep(Kind.DENSE, -2, None)
        if cat == "cast":
            return d0 if track else None
        if cat == "expand":
            return d0 if track else None
        if cat == "sum":
            if not track:
                return None
            dims = _dim_arg(n, 1, "dim")
            keep = bool(_dim_arg(n, 2, "keepdim") or False)
            if dims is None:
                self.layout(n, "sums over every axis of the state")
            dims = [dims] if isinstance(dims, int) else list(dims)
            nd = self.ndim(a[0])
            out = d0
            for dd in sorted((_norm(int(x), nd) for x in dims), reverse=True):
                out = self.reduced(n, out, dd, keep)
            return out
        if cat in ("transpose", "permute"):
            if not track:
                return None
            nd = self.ndim(a[0])
            if cat == "transpose" and n.target == "t" or (cat == "transpose" and len(a) == 1):
                perm = {-1: -2, -2: -1}
            elif cat == "transpose":
                p, q = _norm(int(a[1]), nd), _norm(int(a[2]), nd)
                perm = {p: q, q: p}
            else:
                order = a[1:] if not (len(a) == 2 and isinstance(a[1], (list, tuple))) else a[1]
                perm = {_norm(int(o), nd): i - nd for i, o in enumerate(order)}
            move = lambda p: None if p is None else perm.get(p, p)  # noqa: E731
            return Dep(d0.kind, move(d0.vpos), move(d0.kpos))
        if cat == "getattr":
            if a[1] in ("mT", "T") and track:
                return Dep(d0.kind, {-1: -2, -2: -1}.get(d0.vpos, d0.vpos) if d0.vpos else None,
                           {-1: -2, -2: -1}.get(d0.kpos, d0.kpos) if d0.kpos else None)
            return d0 if track else None
        if cat == "unsqueeze":
            if not track:
                return None
            dn = _norm(int(a[1]), self.ndim(n))
            move = lambda p: None if p is None else (p - 1 if p < dn else p)  # noqa: E731
            return Dep(d0.kind, move(d0.vpos), move(d0.kpos))
        if cat == "getitem":
            if not track:
                return None
            return self.indexed(n, d0)
        if cat == "where":
            cond, x, y = a[0], a[1], a[2]
            if self.is_dep(cond) or not self.is_dep(x) or not (isinstance(y, (int, float))
                                                                and y == 0):
                self.nonaffine(n, "only torch.where(condition, state_term, 0) is linear")
            if track:
                self.layout(n, "masks the state")
            return None
        if cat == "masked_fill":
            if self.is_dep(a[1]) or not (isinstance(a[2], (int, float)) and a[2] == 0):
                self.nonaffine(n, "only masked_fill(mask, 0) is linear")
            if track:
                self.layout(n, "masks the state")
            return None
        if cat == "einsum":
            if len(deps) != 1 or sum(1 for x in a[1:] if self.is_dep(x)) != 1:
                self.nonaffine(n, "an einsum with more than one state-dependent operand")
            if track:
                self.layout(n, "einsum on the state is not classified; write it with @ and *")
            return None
        if cat in ("mask", "view", "cat"):
            if cat == "cat":
                seq = a[0]
                if any(not self.is_dep(x) for x in seq):
                    self.nonaffine(n, "concatenates state-dependent and free values")
            if track:
                self.layout(n, f"{op_name(n)} on the state is not classified")
            return None
        if n.op == "call_function" and n.target is torch.square:  # x * x, x ** 2
            self.nonaffine(n, "multiplies or divides two state-dependent values (a square)")
        self.nonaffine(n, "is applied to a value that depends on the state")

    def to_dense(self, n, kind):
        if self.vector:
            self.layout(n, "mixes the D axis of a vector state")
        return Kind.DENSE

    def scaled(self, n: fx.Node, d: Dep, factor_shape, out_ndim: int) -> Dep:
        def size_at(p):
            if p is None or -p > len(factor_shape):
                return "1"
            return factor_shape[p]
        if d.vpos is not None and size_at(d.vpos) != "1":
            self.layout(n, f"the factor (shape {shape_text(factor_shape)}) varies along the "
                           f"state's V axis")
        if d.kind is Kind.DENSE or d.kpos is None:
            return Dep(d.kind, d.vpos, d.kpos)
        step = Kind.DIAGONAL if size_at(d.kpos) != "1" else Kind.SCALAR
        return Dep(widest(d.kind, step), d.vpos, d.kpos)

    def reduced(self, n, d: Dep, dd: int, keep: bool) -> Dep:
        if dd == d.vpos:
            self.layout(n, "sums over the state's V axis")
        kind, kpos = d.kind, d.kpos
        if dd == d.kpos:
            kind, kpos = self.to_dense(n, kind), None
        if keep:
            return Dep(kind, d.vpos, kpos if dd != d.kpos else None)
        move = lambda p: None if p is None else (p + 1 if p < dd else p)  # noqa: E731
        return Dep(kind, move(d.vpos), move(kpos))

    def indexed(self, n: fx.Node, d: Dep) -> Dep:
        idx = n.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        m = max([-p for p in (d.vpos, d.kpos) if p is not None] or [1])
        if any(isinstance(i, fx.Node) for i in idx):
            self.layout(n, "indexes the state with a tensor")
        if Ellipsis in idx:
            tail = idx[idx.index(Ellipsis) + 1:]
            ok = len(tail) >= m and all(i == slice(None) for i in tail[len(tail) - m:]) \
                and not any(i == slice(None) and False for i in tail)
        else:
            used = sum(1 for i in idx if i is not None)
            ok = used <= self.ndim(n.args[0]) - m
        if not ok:
            self.layout(n, "indexes the state's K / V axes")
        return d


def linear_part(phase: Phase, dependent: set) -> fx.GraphModule:
    """The graph of ``S -> f(S) - f(0)``: state-free addends dropped (same parameters)."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for n in phase.gm.graph.nodes:
        if n.op == "output":
            g.output(fx.node.map_arg(n.args[0], lambda a: env[a]))
            continue
        cat = _category(n)
        if n.name in dependent and cat in ("add", "sub"):
            x, y = n.args[0], n.args[1]
            x_dep = isinstance(x, fx.Node) and x.name in dependent
            y_dep = isinstance(y, fx.Node) and y.name in dependent
            if x_dep and not y_dep:
                env[n] = env[x]
                continue
            if y_dep and not x_dep:
                env[n] = env[y] if cat == "add" else g.call_function(operator.neg, (env[y],))
                continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.eliminate_dead_code()
    return fx.GraphModule(phase.gm, g)


# ops that map a zero state-dependent operand to zero (the analysis admits only linear uses
# of the state: a factor times it, its sums, views, masks)
_ZERO_TO_ZERO = {"mul", "div", "matmul", "neg", "cast", "sum", "transpose", "permute",
                 "unsqueeze", "expand", "mask", "view", "getitem", "where", "masked_fill",
                 "einsum"}


def offset_part(phase: Phase, dependent: set) -> Optional[fx.GraphModule]:
    """The graph of ``S -> f(0)``: every state-dependent term dropped (same parameters; the
    state's is unused), or ``None`` where that value is not a graph of the other inputs (an
    offset that is a bare number, an op the table above does not cover, a result that is
    zero, a read of the state's dtype or shape).  Compilation checks it against ``f(0)``
    (:mod:`.validate`)."""
    g = fx.Graph()
    env: Dict[fx.Node, Any] = {}
    zero = object()  # a state-dependent value at S = 0 whose value is 0

    def value(a):
        return env[a] if isinstance(a, fx.Node) else a

    for n in phase.gm.graph.nodes:
        if n.op == "output":
            out = value(n.args[0])
            if not isinstance(out, fx.Node):
                return None
            g.output(out)
            continue
        if n.op == "placeholder":
            node = g.node_copy(n)
            env[n] = zero if n.name in dependent else node
            continue
        if n.name not in dependent:
            if any(env[a] is zero for a in n.all_input_nodes):
                return None  # reads the state's metadata (dtype, shape): no state-free graph
            env[n] = g.node_copy(n, lambda a: env[a])
            continue
        cat = _category(n)
        args = [value(a) for a in n.args]
        if cat in ("add", "sub") and len(args) == 2 and not n.kwargs:
            x, y = args
            if x is zero and y is zero:
                env[n] = zero
            elif not all(isinstance(a, fx.Node) or a is zero for a in (x, y)):
                return None  # an offset that is a bare number
            elif y is zero:
                env[n] = x
            elif x is zero:
                env[n] = y if cat == "add" else g.call_function(operator.neg, (y,))
            else:
                env[n] = g.node_copy(n, lambda a: env[a])
        elif cat in _ZERO_TO_ZERO:
            # linear in its one state-dependent operand: zero where that is (else the op
            # applies to the operand's offset, as in ``scale * (intra + q @ S)``)
            env[n] = zero if any(env[a] is zero for a in n.all_input_nodes) else \
                g.node_copy(n, lambda a: env[a])
        else:
            return None
    g.eliminate_dead_code()
    return fx.GraphModule(phase.gm, g)


def offset_parameter(phase: Phase, dependent: set) -> Optional[str]:
    """The parameter that *is* the phase's state-free offset, when the result is written
    ``<state-dependent term> + <that parameter>`` (``decay_mode``'s usual ``... +
    chunk_state``), else ``None``: then ``f(0)`` is that argument, with nothing to run."""
    out = next(n for n in phase.gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node) or _category(out) != "add" or len(out.args) != 2 \
            or out.kwargs:
        return None
    x, y = out.args
    for term, offset in ((x, y), (y, x)):
        if isinstance(term, fx.Node) and term.name in dependent and \
                isinstance(offset, fx.Node) and offset.op == "placeholder" and \
                offset.name not in dependent:
            return offset.target
    return None


def analyse(phase: Phase, *, state: str = "state", track_kind: bool, vector: bool,
            expect: Tuple[str, ...]) -> Affine:
    """Check that ``phase`` is affine in ``state`` (and classify it when ``track_kind``).

    ``expect`` is the required output shape (dim names).  Raises :class:`DSLError`.
    """
    if state not in phase.params:
        raise DSLError(f"{phase.name}: expected a parameter named {state!r} (the state at the "
                       f"chunk start); got parameters {phase.params}")
    walk = _Walk(phase, state, track_kind, vector)
    walk.run()
    out = next(n for n in phase.gm.graph.nodes if n.op == "output")
    result = out.args[0]
    if not isinstance(result, fx.Node):
        raise DSLError(f"{phase.name}: must return one tensor, got {type(result).__name__}")
    got = phase.node_shape(result)
    if got != tuple(expect):
        raise DSLError(f"{phase.name}: returns shape {shape_text(got)} at {where(result)}; "
                       f"expected {shape_text(expect)}")
    if result not in walk.dep:
        raise DSLError(f"{phase.name}: the result does not depend on {state!r} "
                       f"(returned at {where(result)})")
    kind = None
    if track_kind:
        d = walk.dep[result]
        if d.kind is not Kind.DENSE:
            want = (None, -1) if vector else (-1, -2)
            if (d.vpos, d.kpos) != want:
                raise DSLError(f"{phase.name}: the result at {where(result)} does not keep the "
                               f"state's [..., K, V] layout")
        elif d.vpos != -1:
            raise DSLError(f"{phase.name}: the result at {where(result)} has the state's V "
                           f"axis in the wrong place (a transposed state?)")
        kind = d.kind
    names = {n.name for n in walk.dep}
    return Affine(kind, names, linear_part(phase, names))

"""Capture the three user callables as size-free ``torch.fx`` graphs, and name their shapes.

Each callable is traced with :class:`torch.fx.Tracer` (Proxy tracing: the graph holds no
sizes, so one graph serves every sequence length and chunk length), then its shapes are
propagated with fake tensors whose sizes are distinct primes named back to their dims
(``B, H, NT, C, K, V`` or ``B, NT, C, D``).  Every node remembers the user source line that
created it, so checks can name the offending line.

``cache(name, x)`` marks an intermediate of ``chunk_mode`` for reuse by the later phases
(the paper's ``forge.cache_result``); in the graph it is a ``call_function`` node that the
tracer turns into an extra graph output.
"""
from __future__ import annotations

import inspect
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .canonical import canonicalise

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# Library frames never named as "the user's line": the tracer itself and the helpers.
_SKIP = {os.path.join(_HERE, f) for f in ("trace.py", "helpers.py")}


class DSLError(ValueError):
    """A variant program that cannot be compiled; the message names the op and source line."""


def cache(name: str, x):
    """Keep ``x`` (computed in ``chunk_mode``) for ``decay_mode`` / ``merge_mode``, which take it
    as a parameter called ``name``.  Returns ``x`` unchanged."""
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", cache, (name, x), {})
    return x


def _user_frames(summary) -> List[traceback.FrameSummary]:
    """Frames outside torch and outside this package's tracing machinery."""
    out = []
    for fr in summary:
        path = os.path.abspath(fr.filename)
        if path.startswith(_TORCH) or path in _SKIP:
            continue
        if "/torch/" in path or path.startswith("<frozen"):
            continue
        out.append(fr)
    return out


class _Tracer(fx.Tracer):
    """Records, per node, the innermost user frame that created it."""

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        frames = _user_frames(traceback.extract_stack()[:-1])
        if frames:
            fr = frames[-1]
            node.meta["dsl_source"] = (os.path.basename(fr.filename), fr.lineno,
                                       (fr.line or "").strip())
        return node


def op_name(node: fx.Node) -> str:
    """Readable name of a node's operation (``torch.relu``, ``Tensor.exp``, ``@`` ...)."""
    if "dsl_op" in node.meta:  # what the user wrote, before canonicalisation
        return node.meta["dsl_op"]
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module {t}"
    if node.op == "call_function":
        mod = getattr(t, "__module__", "") or ""
        name = getattr(t, "__name__", str(t))
        if mod == "_operator":
            return {"matmul": "@ (matmul)", "mul": "* (mul)", "truediv": "/ (div)",
                    "add": "+ (add)", "sub": "- (sub)", "pow": "** (pow)",
                    "getitem": "indexing"}.get(name, f"operator.{name}")
        if mod.startswith("torch"):
            return f"{mod.replace('torch._C._nn', 'torch.nn.functional').replace('torch._C._linalg', 'torch.linalg')}.{name}" \
                if mod not in ("torch", "torch._C._VariableFunctions") else f"torch.{name}"
        return name
    return f"{node.op} {t}"


def where(node: fx.Node) -> str:
    """``file:line: code`` of the user line that produced ``node`` (or a placeholder text)."""
    src = node.meta.get("dsl_source")
    if src is None:
        return "(no source line recorded)"
    f, line, code = src
    return f"{f}:{line}: {code}"


@dataclass
class Phase:
    """One traced callable.

    Attributes:
        name: ``chunk_mode`` / ``decay_mode`` / ``merge_mode``.
        gm: the graph module; its output is ``(result, *cached)`` (chunk_mode) or ``result``.
        params: the callable's parameter names, in order (graph placeholders).
        cached: names marked with :func:`cache` (chunk_mode only), in output order.
        shapes: node name -> shape as dim names (``("B", "H", "NT", "C", "K")``),
            from the fake-tensor propagation.
    """

    name: str
    fn: Callable
    gm: fx.GraphModule
    params: List[str]
    cached: List[str] = field(default_factory=list)
    shapes: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

    def node_shape(self, node) -> Optional[Tuple[str, ...]]:
        return self.shapes.get(node.name) if isinstance(node, fx.Node) else None


def _params(fn: Callable, phase: str) -> List[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise DSLError(f"{phase}: cannot read the signature of {fn!r}: {e}") from None
    names = []
    for p in sig.parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise DSLError(f"{phase}: parameter {p.name!r} must be a plain named parameter "
                           f"(no *args / **kwargs): inputs are passed by name")
        names.append(p.name)
    return names


def trace_phase(fn: Callable, phase: str) -> Phase:
    """Trace ``fn`` into a :class:`Phase`; errors name the user line that failed."""
    if not callable(fn):
        raise DSLError(f"{phase}: expected a callable, got {type(fn).__name__}")
    params = _params(fn, phase)
    tracer = _Tracer()
    try:
        graph = tracer.trace(fn)
    except DSLError:
        raise
    except Exception as e:  # noqa: BLE001 - report any tracing failure with its user line
        frames = _user_frames(traceback.extract_tb(e.__traceback__))
        loc = (f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}: "
               f"{(frames[-1].line or '').strip()}") if frames else "(unknown line)"
        hint = ""
        if isinstance(e, fx.proxy.TraceError) or "symbolically traced" in str(e):
            hint = (" (Python control flow on tensor values, len() or .item() cannot be "
                    "traced: write it with tensor ops such as torch.where)")
        raise DSLError(f"{phase}: unsupported operation at {loc}: "
                       f"{type(e).__name__}: {e}{hint}") from None
    gm = fx.GraphModule(tracer.root, graph)
    cached = _outline_cache(gm, phase)
    canonicalise(gm)
    return Phase(phase, fn, gm, params, cached)


def _outline_cache(gm: fx.GraphModule, phase: str) -> List[str]:
    """Turn ``cache(name, x)`` nodes into extra outputs: output becomes ``(result, *cached)``."""
    g = gm.graph
    names, values = [], []
    for node in list(g.nodes):
        if node.op == "call_function" and node.target is cache:
            name, value = node.args
            if phase != "chunk_mode":
                raise DSLError(f"{phase}: cache() is only for chunk_mode results, at "
                               f"{where(node)}")
            if not isinstance(name, str) or not name.isidentifier():
                raise DSLError(f"chunk_mode: cache() needs an identifier name, got {name!r} "
                               f"at {where(node)}")
            if name in names:
                raise DSLError(f"chunk_mode: cache({name!r}) appears twice ({where(node)})")
            node.replace_all_uses_with(value)
            g.erase_node(node)
            names.append(name)
            values.append(value)
    if names:
        out = next(n for n in g.nodes if n.op == "output")
        out.args = ((out.args[0], *values),)
        g.lint()
        gm.recompile()
    return names


# ------------------------------------------------------------------------------------------
# Symbolic shape propagation
# ------------------------------------------------------------------------------------------

# Distinct primes, so that every named dimension has its own size and sizes can be named
# back (a product of two dims, such as a reshape's NT * C, is not a prime and shows as a
# number).
MATRIX_DIMS = {"B": 2, "H": 3, "NT": 5, "C": 7, "K": 11, "V": 13}
VECTOR_DIMS = {"B": 2, "NT": 5, "C": 7, "D": 11}


class ShapeContext:
    """Fake-tensor mode with the probe sizes above; names sizes back to dimension names.

    Sizes are static (plain ints): the graphs themselves hold no sizes (Proxy tracing), so
    symbolic sizes would only name products of dims, at about a second of sympy work per
    variant; torch 2.11 specialised symbolic probe sizes to these ints anyway.
    """

    def __init__(self, dims: Dict[str, int]):
        self.dims = dims
        self.by_hint = {v: k for k, v in dims.items()}
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(self, names: Sequence[str], dtype=torch.float32):
        return self.mode.from_tensor(torch.empty([self.dims[n] for n in names], dtype=dtype))

    def name_of(self, size) -> str:
        return self.by_hint.get(int(size), str(int(size)))


def _solve_shape(A, B, *args, **kwargs):
    # same shape as the solution: batch dims broadcast, then B's trailing [C, V]
    return B + A[..., :, :1] * 0


# Ops whose meta kernels reject symbolic sizes (torch 2.13): shape-equivalent surrogates used
# only during shape propagation.
_SHAPE_RULES = {"linalg_solve_triangular": _solve_shape, "solve_triangular": _solve_shape,
                "linalg_solve": lambda A, B, *a, **k: _solve_shape(A, B),
                "linalg_inv": lambda A, *a, **k: A * 1, "inverse": lambda A, *a, **k: A * 1}


def propagate(phase: Phase, ctx: ShapeContext, args: Dict[str, object]) -> object:
    """Run ``phase`` on fake tensors ``args`` (by parameter name), filling ``phase.shapes``.

    Returns the fake result.  Shape errors name the user line.
    """
    shapes = phase.shapes

    class _Prop(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            rule = _SHAPE_RULES.get(getattr(target, "__name__", None))
            if rule is not None:
                return rule(*args, **kwargs)
            return super().call_function(target, args, kwargs)

        def run_node(self, n):
            try:
                result = super().run_node(n)
            except DSLError:
                raise
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DSLError(f"{phase.name}: {op_name(n)} failed at {where(n)}: {msg}") \
                    from None
            if isinstance(result, torch.Tensor):
                shapes[n.name] = tuple(ctx.name_of(s) for s in result.shape)
            return result

    missing = [p for p in phase.params if p not in args]
    if missing:
        raise DSLError(f"{phase.name}: parameter(s) {missing} are neither inputs of the variant "
                       f"nor available here (known: {sorted(args)})")
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # its meta-kernel failures are re-raised as DSLError here
    try:
        with ctx.mode:
            return _Prop(phase.gm).run(*[args[p] for p in phase.params])
    finally:
        log.setLevel(level)


def shape_text(shape: Optional[Tuple[str, ...]]) -> str:
    return "?" if shape is None else "[" + ", ".join(shape) + "]"

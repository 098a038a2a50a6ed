"""``torch.library`` custom ops for every registered op (:mod:`forge_dist.variants.registry`), so that ``torch.compile`` traces through
a layer without breaking the graph at the recurrence.

Each op ``forge_dist::<name>`` wraps the eager op of :mod:`forge_dist.ops.attention` as an
opaque node:

* forward runs the eager op under ``torch.no_grad()`` (its cross-rank state pass included);
* a shape function (``register_fake``) gives FakeTensor outputs for tracing;
* the backward is a second custom op, ``forge_dist::<name>_backward``, which recomputes the eager
  op under ``torch.enable_grad()`` on detached inputs and calls ``torch.autograd.grad``, so the
  existing (cross-rank) autograd of the eager op computes the gradients.  The recompute costs
  one more forward per backward (activation-checkpoint style); every rank runs it at the same
  point of its backward, so the collectives of the recompute and of the backward match across
  ranks exactly as in eager mode.

Process groups are not a custom-op argument type: the wrappers pass ``group.group_name`` (a
``str``) and the op resolves it with ``torch.distributed.distributed_c10d._resolve_process_group``.

Each op's schema, shape function and wrapper are read off its public function's signature
(:func:`_register`), so a new registered op needs nothing here.  Use the wrappers here
directly (same signatures as :mod:`forge_dist.ops`), or call
:func:`enable` to make the :mod:`forge_dist.nn` layers use them (``use_custom_ops=True`` on a
layer does the same for one layer).  Double backward is not supported.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..variants import registry
from . import attention

__all__ = ["enable", "disable", "enabled", "use", "group_name", "resolve_group",
           *registry.names()]

_ENABLED = False


def enable() -> None:
    """Make every :mod:`forge_dist.nn` layer call the custom ops (for ``torch.compile``)."""
    global _ENABLED
    _ENABLED = True


def disable() -> None:
    global _ENABLED
    _ENABLED = False


def enabled() -> bool:
    return _ENABLED


@contextlib.contextmanager
def use(flag: bool = True):
    """Context manager: custom ops on (or off) inside the block."""
    global _ENABLED
    old, _ENABLED = _ENABLED, flag
    try:
        yield
    finally:
        _ENABLED = old


# ------------------------------------------------------------------------------- groups
def group_name(group) -> Optional[str]:
    """The name a custom op receives for ``group`` (``None`` for no group)."""
    return None if group is None else group.group_name


def resolve_group(name: Optional[str]):
    """Inverse of :func:`group_name`: the live process group registered under ``name``."""
    if name is None:
        return None
    # lazy: private c10d API, absent where torch.distributed is not available
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


# ------------------------------------------------------------- the ops' signatures
# Each custom op takes ``(*tensor inputs, initial_state, cu_seqlens, *options)``: the public
# op's positional tensors, then its keyword arguments in the order it declares them, with
# ``group`` passed as ``group_name`` (a ``str``; process groups are no schema type).
_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", Optional[float]: "float?",
                 float: "float", bool: "bool", str: "str"}
_STATE_ARGS = ("initial_state", "cu_seqlens")


@dataclass(frozen=True)
class _Signature:
    """One registered op's custom-op layout, read off its public function in :mod:`.attention`.

    ``tensors``: the positional tensor inputs (``("q", "k", "v", "g")``); ``options``: the
    keyword arguments after ``initial_state`` and ``cu_seqlens`` (``group`` as
    ``group_name``); ``defaults``: the public defaults by name; ``schema``: the
    ``torch.library`` schema."""

    op: str
    tensors: Tuple[str, ...]
    options: Tuple[str, ...]
    defaults: Dict[str, Any]
    schema: str

    def args(self, a: Dict[str, Any]) -> list:
        """The custom op's positional arguments from the public op's arguments ``a``."""
        rest = [group_name(a["group"]) if n == "group_name" else a[n] for n in self.options]
        return [a[n] for n in self.tensors] + [a[n] for n in _STATE_ARGS] + rest

    def named(self, args: Sequence) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Inverse of :meth:`args`: ``(tensors by name, keyword arguments by name)``."""
        n = len(self.tensors)
        tensors = dict(zip(self.tensors, args[:n]))
        kw = dict(zip(_STATE_ARGS + self.options, args[n:]))
        return tensors, kw


def _signature(op: str) -> _Signature:
    fn = getattr(attention, op)
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())
    tensors = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    inputs = registry.get(op).inputs  # the registered inputs first, then extras (g_gamma)
    if tensors[:len(inputs)] != inputs or \
            not set(_STATE_ARGS) <= set(keywords):
        raise TypeError(f"forge_dist.ops.{op}'s signature does not fit the custom-op layout "
                        f"(tensor inputs {tensors}, keyword arguments {keywords})")
    options = tuple("group_name" if n == "group" else n for n in keywords
                    if n not in _STATE_ARGS)

    def typed(name: str) -> str:
        if name == "group_name":
            return "str? group_name"
        hint = hints.get(name)
        if hint not in _SCHEMA_TYPES:
            raise TypeError(f"forge_dist.ops.{op}: argument {name!r} has type {hint!r}, which "
                            f"custom_ops cannot pass (known: {list(_SCHEMA_TYPES.values())})")
        return f"{_SCHEMA_TYPES[hint]} {name}"
    schema = "(" + ", ".join(typed(n) for n in tensors + _STATE_ARGS + options) + \
        ") -> (Tensor, Tensor)"
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    return _Signature(op, tensors, options, defaults, schema)


def _eager(op: str, tensors: Dict[str, Optional[Tensor]], kw: Dict[str, Any]):
    """The public op on ``tensors`` with the custom op's keyword arguments ``kw``."""
    kw = dict(kw)
    kw["group"] = resolve_group(kw.pop("group_name"))
    return getattr(attention, op)(**tensors, **kw)


def _forward(op: str, tensors: Dict[str, Optional[Tensor]],
             kw: Dict[str, Any]) -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        o, final = _eager(op, tensors, kw)
    if final is None:
        final = o.new_empty((0,), dtype=torch.float32)
    o, final = o.contiguous(), final.contiguous()  # the shape functions promise contiguous
    # custom ops may not return (views of) their inputs
    inputs = [x for x in list(tensors.values()) + [kw["initial_state"]] if x is not None]
    ptrs = {x.untyped_storage().data_ptr() for x in inputs}
    o = o.clone() if o.untyped_storage().data_ptr() in ptrs else o
    final = final.clone() if final.untyped_storage().data_ptr() in ptrs else final
    return o, final


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _output_like(op: str, tensors: Dict[str, Optional[Tensor]]) -> Tensor:
    """The input whose shape the output takes (``v``; ``x`` for a vector state)."""
    return tensors["x"] if registry.get(op).vector_state else tensors["v"]


def _fake(op: str, tensors: Dict[str, Optional[Tensor]], kw: Dict[str, Any]):
    """FakeTensor outputs: ``o`` shaped like :func:`_output_like` in the first input's dtype,
    the final state ``[N, H, K, V]`` (``[N, D]``) or empty."""
    first, like = next(iter(tensors.values())), _output_like(op, tensors)
    o = torch.empty(like.shape, dtype=first.dtype, device=first.device)
    if not kw["output_final_state"]:
        return o, torch.empty((0,), dtype=torch.float32, device=first.device)
    cu_seqlens = kw["cu_seqlens"]
    rows = first.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if registry.get(op).vector_state:
        dims = (like.shape[-1],)
    else:
        dims = (first.shape[2], first.shape[3], like.shape[-1])
    return o, torch.empty((rows,) + dims, dtype=_state_dtype(first.dtype), device=first.device)


# ---------------------------------------------------------------------------- backward
@contextlib.contextmanager
def _autograd_dispatch():
    """Autograd on inside a custom op's kernel.

    A custom op's kernel runs below the Autograd dispatch key (the key is in the thread's
    exclude set), so ``torch.enable_grad()`` alone records nothing; re-include the key for the
    recompute and restore the exclude set afterwards.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    old = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for k in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(keys, old):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def _backward(op: str, tensors: Dict[str, Optional[Tensor]], kw: Dict[str, Any],
              needs: Sequence[bool], grad_o: Tensor,
              grad_final: Optional[Tensor]) -> List[Tensor]:
    """Gradients for the tensor inputs and ``initial_state`` (an empty tensor where not
    needed): the eager op recomputed on detached leaves, then autograd."""
    all_in = list(tensors.values()) + [kw["initial_state"]]
    leaves = [None if (x is None or not need) else x.detach().requires_grad_(True)
              for x, need in zip(all_in, needs)]
    args = [leaf if leaf is not None else (None if x is None else x.detach())
            for x, leaf in zip(all_in, leaves)]
    with _autograd_dispatch():
        o, final = _eager(op, dict(zip(tensors, args[:-1])), dict(kw, initial_state=args[-1]))
        outs, grads = [o], [grad_o]
        if final is not None and grad_final is not None and grad_final.numel():
            outs.append(final)
            grads.append(grad_final)
        # ``backward`` (not ``autograd.grad(inputs=...)``): the engine must run the whole
        # graph, including the state pass that the last rank joins only through an anchor
        # leaf; pruning it to the paths to ``leaves`` skips that rank's collective and
        # deadlocks the others.  The leaves are fresh, so accumulation is local.
        torch.autograd.backward(outs, grads)
    result = []
    for x, leaf in zip(all_in, leaves):
        if leaf is None:
            result.append(torch.empty((0,), dtype=torch.float32, device=grad_o.device))
        else:
            g = leaf.grad
            result.append(torch.zeros_like(x) if g is None else g.contiguous())
    return result


def _backward_fake(tensors: Dict[str, Optional[Tensor]], kw: Dict[str, Any],
                   needs: Sequence[bool], grad_o: Tensor) -> List[Tensor]:
    all_in = list(tensors.values()) + [kw["initial_state"]]
    return [torch.empty((0,), dtype=torch.float32, device=grad_o.device)
            if (x is None or not need) else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            for x, need in zip(all_in, needs)]


# ------------------------------------------------------------------- one op per variant
def _register(op: str):
    """Define ``forge_dist::<op>`` and ``forge_dist::<op>_backward`` from the public op's
    signature, with the shape functions and the autograd formula; return the wrapper with
    the public op's signature."""
    sig = _signature(op)
    n_in = len(sig.tensors)
    args_schema = sig.schema[1:sig.schema.index(") -> ")]

    def forward(*args):
        return _forward(op, *sig.named(args))

    def backward_op(*args):
        *fwd, needs, grad_o, grad_final = args
        return _backward(op, *sig.named(fwd), needs, grad_o, grad_final)

    custom = torch.library.custom_op(f"forge_dist::{op}", forward, mutates_args=(),
                                     schema=sig.schema)
    custom.register_fake(lambda *args: _fake(op, *sig.named(args)))
    grad = torch.library.custom_op(
        f"forge_dist::{op}_backward", backward_op, mutates_args=(),
        schema=f"({args_schema}, bool[] needs, Tensor grad_o, Tensor? grad_final) -> Tensor[]")
    grad.register_fake(lambda *args: _backward_fake(*sig.named(args[:-3]), args[-3], args[-2]))

    def setup_context(ctx, inputs, output):
        ctx.present = [x is not None for x in inputs[:n_in + 2]]
        ctx.save_for_backward(*[x for x in inputs[:n_in + 2] if x is not None])
        ctx.options = inputs[n_in + 2:]

    def backward(ctx, grad_o, grad_final):
        saved = iter(ctx.saved_tensors)
        fwd = [next(saved) if p else None for p in ctx.present] + list(ctx.options)
        needs = list(ctx.needs_input_grad[:n_in + 1])  # the tensors and initial_state
        if not any(needs):
            return (None,) * len(ctx.needs_input_grad)
        tensors, kw = sig.named(fwd)
        if grad_o is None:  # (materialised by autograd; kept for safety)
            like = _output_like(op, tensors)
            grad_o = torch.zeros(like.shape, dtype=fwd[0].dtype, device=like.device)
        grads = grad(*fwd, needs, grad_o, grad_final if kw["output_final_state"] else None)
        out = [g if need else None for g, need in zip(grads, needs)]
        return tuple(out) + (None,) * (len(ctx.needs_input_grad) - len(out))

    custom.register_autograd(backward, setup_context=setup_context)
    public = getattr(attention, op)
    positional = sig.tensors

    @functools.wraps(public)
    def wrapper(*args, **kwargs):
        if len(args) > len(positional):
            raise TypeError(f"{op}() takes {len(positional)} positional arguments "
                            f"({', '.join(positional)}) but {len(args)} were given")
        a = dict(sig.defaults)
        a.update(zip(positional, args))
        unknown = set(kwargs) - set(positional) - set(sig.defaults)
        if unknown:
            raise TypeError(f"{op}() got unexpected keyword arguments {sorted(unknown)}")
        twice = set(kwargs) & set(positional[:len(args)])
        if twice:
            raise TypeError(f"{op}() got multiple values for arguments {sorted(twice)}")
        a.update(kwargs)
        missing = [n for n in positional if n not in a]
        if missing:
            raise TypeError(f"{op}() missing required arguments {missing}")
        o, final = custom(*sig.args(a))
        return o, (final if a["output_final_state"] else None)

    wrapper.__doc__ = f":func:`forge_dist.ops.{op}` as the custom op ``forge_dist::{op}``."
    return wrapper


# every registered variant, under its own name (forge_dist.ops.custom_ops.gla, ...)
for _op in registry.names():
    globals()[_op] = _register(_op)
del _op

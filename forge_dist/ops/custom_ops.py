"""``torch.library`` custom ops for the five core ops, so that ``torch.compile`` traces through
a layer without breaking the graph at the recurrence.

Each op ``forge_dist::<name>`` wraps the eager op of :mod:`forge_dist.ops.attention` as an
opaque node:

* forward runs the eager op under ``torch.no_grad()`` (its cross-rank state pass included);
* a shape function (``register_fake``) gives FakeTensor outputs for tracing;
* the backward is a second custom op, ``forge_dist::sp_backward``, which recomputes the eager
  op under ``torch.enable_grad()`` on detached inputs and calls ``torch.autograd.grad``, so the
  existing (cross-rank) autograd of the eager op computes the gradients.  The recompute costs
  one more forward per backward (activation-checkpoint style); every rank runs it at the same
  point of its backward, so the collectives of the recompute and of the backward match across
  ranks exactly as in eager mode.

Process groups are not a custom-op argument type: the wrappers pass ``group.group_name`` (a
``str``) and the op resolves it with ``torch.distributed.distributed_c10d._resolve_process_group``.

Use the wrappers here directly (same signatures as :mod:`forge_dist.ops`), or call
:func:`enable` to make the :mod:`forge_dist.nn` layers use them (``use_custom_ops=True`` on a
layer does the same for one layer).  Double backward is not supported.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import attention

__all__ = ["enable", "disable", "enabled", "use", "linear_attn", "simple_gla", "gla",
           "gated_delta_rule", "hgrn", "group_name", "resolve_group"]

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


# ------------------------------------------------------------------- eager calls by name
#: op name -> names of its tensor inputs, in the custom op's order
_INPUTS: Dict[str, Tuple[str, ...]] = {
    "linear_attn": ("q", "k", "v"),
    "simple_gla": ("q", "k", "v", "g", "g_gamma"),
    "gla": ("q", "k", "v", "g"),
    "gated_delta_rule": ("q", "k", "v", "g", "beta"),
    "hgrn": ("x", "g"),
}


def _eager(op: str, tensors: Sequence[Optional[Tensor]], initial_state, cu_seqlens, scale,
           output_final_state: bool, gname: Optional[str], strategy: str, flag: bool):
    t = dict(zip(_INPUTS[op], tensors))
    common = dict(initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, group=resolve_group(gname), strategy=strategy)
    if op == "hgrn":
        return attention.hgrn(t["x"], t["g"], **common)
    if op == "linear_attn":
        return attention.linear_attn(t["q"], t["k"], t["v"], scale=scale, **common)
    if op == "simple_gla":
        return attention.simple_gla(t["q"], t["k"], t["v"], t["g"], t["g_gamma"], scale=scale,
                                    **common)
    if op == "gla":
        return attention.gla(t["q"], t["k"], t["v"], t["g"], scale=scale, **common)
    if op == "gated_delta_rule":
        return attention.gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                          scale=scale, use_qk_l2norm_in_kernel=flag, **common)
    raise ValueError(f"unknown op {op!r}")


def _forward(op, tensors, initial_state, cu_seqlens, scale, output_final_state, gname,
             strategy, flag=False) -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        o, final = _eager(op, tensors, initial_state, cu_seqlens, scale, output_final_state,
                          gname, strategy, flag)
    if final is None:
        final = o.new_empty((0,), dtype=torch.float32)
    o, final = o.contiguous(), final.contiguous()  # the shape functions promise contiguous
    # custom ops may not return (views of) their inputs
    inputs = [x for x in list(tensors) + [initial_state] if x is not None]
    ptrs = {x.untyped_storage().data_ptr() for x in inputs}
    o = o.clone() if o.untyped_storage().data_ptr() in ptrs else o
    final = final.clone() if final.untyped_storage().data_ptr() in ptrs else final
    return o, final


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake(op, out_shape, rows, state_dims, dtype, device, output_final_state):
    o = torch.empty(out_shape, dtype=dtype, device=device)
    if output_final_state:
        final = torch.empty((rows,) + tuple(state_dims), dtype=_state_dtype(dtype), device=device)
    else:
        final = torch.empty((0,), dtype=torch.float32, device=device)
    return o, final


def _rows(B: int, cu_seqlens: Optional[Tensor]) -> int:
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


# ---------------------------------------------------------------------------- backward op
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


@torch.library.custom_op("forge_dist::sp_backward", mutates_args=())
def _sp_backward(op: str, tensors: List[Optional[Tensor]], initial_state: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], scale: Optional[float],
                 output_final_state: bool, group_name: Optional[str], strategy: str,
                 flag: bool, needs: List[bool], grad_o: Tensor,
                 grad_final: Optional[Tensor]) -> List[Tensor]:
    """Gradients for ``tensors + [initial_state]`` (an empty tensor where not needed)."""
    all_in = list(tensors) + [initial_state]
    leaves = [None if (x is None or not need) else x.detach().requires_grad_(True)
              for x, need in zip(all_in, needs)]
    args = [leaf if leaf is not None else (None if x is None else x.detach())
            for x, leaf in zip(all_in, leaves)]
    with _autograd_dispatch():
        o, final = _eager(op, args[:-1], args[-1], cu_seqlens, scale, output_final_state,
                          group_name, strategy, flag)
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


@_sp_backward.register_fake
def _sp_backward_fake(op, tensors, initial_state, cu_seqlens, scale, output_final_state,
                      group_name, strategy, flag, needs, grad_o, grad_final):
    all_in = list(tensors) + [initial_state]
    return [torch.empty((0,), dtype=torch.float32, device=grad_o.device)
            if (x is None or not need) else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            for x, need in zip(all_in, needs)]


def _register_autograd(custom, op: str, n_tensors: int, has_scale: bool, has_flag: bool):
    """Backward for ``custom`` whose args are ``(*tensors, initial_state, cu_seqlens,
    [scale], output_final_state, group_name, strategy, [flag])``."""

    def unpack(inputs):
        tensors = list(inputs[:n_tensors])
        rest = list(inputs[n_tensors:])
        initial_state, cu_seqlens = rest[0], rest[1]
        i = 2
        scale = None
        if has_scale:
            scale, i = rest[2], 3
        output_final_state, gname, strategy = rest[i], rest[i + 1], rest[i + 2]
        flag = rest[i + 3] if has_flag else False
        return tensors, initial_state, cu_seqlens, scale, output_final_state, gname, strategy, flag

    def setup_context(ctx, inputs, output):
        (tensors, initial_state, cu_seqlens, scale, ofs, gname, strategy,
         flag) = unpack(inputs)
        ctx.save_for_backward(*[x for x in tensors + [initial_state, cu_seqlens]
                                if x is not None])
        ctx.present = [x is not None for x in tensors + [initial_state, cu_seqlens]]
        ctx.meta = (scale, ofs, gname, strategy, flag)

    def backward(ctx, grad_o, grad_final):
        saved = iter(ctx.saved_tensors)
        vals = [next(saved) if p else None for p in ctx.present]
        tensors, initial_state, cu_seqlens = vals[:n_tensors], vals[-2], vals[-1]
        scale, ofs, gname, strategy, flag = ctx.meta
        needs = list(ctx.needs_input_grad[:n_tensors + 1])
        if not any(needs):
            return (None,) * len(ctx.needs_input_grad)
        if grad_o is None:  # (materialised by autograd; kept for safety)
            ref = vals[0] if op == "hgrn" else vals[2]
            grad_o = torch.zeros(ref.shape, dtype=vals[0].dtype, device=ref.device)
        grads = torch.ops.forge_dist.sp_backward(
            op, tensors, initial_state, cu_seqlens, scale, ofs, gname, strategy, flag, needs,
            grad_o, grad_final if ofs else None)
        out = [g if need else None for g, need in zip(grads, needs)]
        return tuple(out) + (None,) * (len(ctx.needs_input_grad) - len(out))

    custom.register_autograd(backward, setup_context=setup_context)


# ------------------------------------------------------------------------------ the five ops
@torch.library.custom_op("forge_dist::linear_attn", mutates_args=())
def _linear_attn(q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], scale: Optional[float],
                 output_final_state: bool, group_name: Optional[str],
                 strategy: str) -> Tuple[Tensor, Tensor]:
    return _forward("linear_attn", [q, k, v], initial_state, cu_seqlens, scale,
                    output_final_state, group_name, strategy)


@_linear_attn.register_fake
def _(q, k, v, initial_state, cu_seqlens, scale, output_final_state, group_name, strategy):
    B, T, H, K = q.shape
    return _fake("linear_attn", v.shape, _rows(B, cu_seqlens), (H, K, v.shape[-1]), q.dtype,
                 q.device, output_final_state)


@torch.library.custom_op("forge_dist::simple_gla", mutates_args=())
def _simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], g_gamma: Optional[Tensor],
                initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                scale: Optional[float], output_final_state: bool, group_name: Optional[str],
                strategy: str) -> Tuple[Tensor, Tensor]:
    return _forward("simple_gla", [q, k, v, g, g_gamma], initial_state, cu_seqlens, scale,
                    output_final_state, group_name, strategy)


@_simple_gla.register_fake
def _(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale, output_final_state, group_name,
      strategy):
    B, T, H, K = q.shape
    return _fake("simple_gla", v.shape, _rows(B, cu_seqlens), (H, K, v.shape[-1]), q.dtype,
                 q.device, output_final_state)


@torch.library.custom_op("forge_dist::gla", mutates_args=())
def _gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor],
         cu_seqlens: Optional[Tensor], scale: Optional[float], output_final_state: bool,
         group_name: Optional[str], strategy: str) -> Tuple[Tensor, Tensor]:
    return _forward("gla", [q, k, v, g], initial_state, cu_seqlens, scale, output_final_state,
                    group_name, strategy)


@_gla.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, group_name, strategy):
    B, T, H, K = q.shape
    return _fake("gla", v.shape, _rows(B, cu_seqlens), (H, K, v.shape[-1]), q.dtype, q.device,
                 output_final_state)


@torch.library.custom_op("forge_dist::gated_delta_rule", mutates_args=())
def _gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor,
                      initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                      scale: Optional[float], output_final_state: bool,
                      group_name: Optional[str], strategy: str,
                      use_qk_l2norm_in_kernel: bool) -> Tuple[Tensor, Tensor]:
    return _forward("gated_delta_rule", [q, k, v, g, beta], initial_state, cu_seqlens, scale,
                    output_final_state, group_name, strategy, use_qk_l2norm_in_kernel)


@_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, group_name,
      strategy, use_qk_l2norm_in_kernel):
    B, T, H, K = q.shape
    return _fake("gated_delta_rule", v.shape, _rows(B, cu_seqlens), (H, K, v.shape[-1]),
                 q.dtype, q.device, output_final_state)


@torch.library.custom_op("forge_dist::hgrn", mutates_args=())
def _hgrn(x: Tensor, g: Tensor, initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
          output_final_state: bool, group_name: Optional[str],
          strategy: str) -> Tuple[Tensor, Tensor]:
    return _forward("hgrn", [x, g], initial_state, cu_seqlens, None, output_final_state,
                    group_name, strategy)


@_hgrn.register_fake
def _(x, g, initial_state, cu_seqlens, output_final_state, group_name, strategy):
    B, T, D = x.shape
    return _fake("hgrn", x.shape, _rows(B, cu_seqlens), (D,), x.dtype, x.device,
                 output_final_state)


_register_autograd(_linear_attn, "linear_attn", 3, True, False)
_register_autograd(_simple_gla, "simple_gla", 5, True, False)
_register_autograd(_gla, "gla", 4, True, False)
_register_autograd(_gated_delta_rule, "gated_delta_rule", 5, True, True)
_register_autograd(_hgrn, "hgrn", 2, False, False)


# ---------------------------------------------------------- wrappers with the ops' signatures
def _ret(o, final, output_final_state):
    return o, (final if output_final_state else None)


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, group=None, strategy="auto"):
    """:func:`forge_dist.ops.linear_attn` as the custom op ``forge_dist::linear_attn``."""
    o, f = torch.ops.forge_dist.linear_attn(q, k, v, initial_state, cu_seqlens, scale,
                                            output_final_state, group_name(group), strategy)
    return _ret(o, f, output_final_state)


def simple_gla(q, k, v, g=None, g_gamma=None, *, scale=None, initial_state=None,
               output_final_state=False, cu_seqlens=None, group=None, strategy="auto"):
    """:func:`forge_dist.ops.simple_gla` as the custom op ``forge_dist::simple_gla``."""
    o, f = torch.ops.forge_dist.simple_gla(q, k, v, g, g_gamma, initial_state, cu_seqlens, scale,
                                           output_final_state, group_name(group), strategy)
    return _ret(o, f, output_final_state)


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, group=None, strategy="auto"):
    """:func:`forge_dist.ops.gla` as the custom op ``forge_dist::gla``."""
    o, f = torch.ops.forge_dist.gla(q, k, v, g, initial_state, cu_seqlens, scale,
                                    output_final_state, group_name(group), strategy)
    return _ret(o, f, output_final_state)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False, group=None, strategy="auto"):
    """:func:`forge_dist.ops.gated_delta_rule` as the custom op ``forge_dist::gated_delta_rule``."""
    o, f = torch.ops.forge_dist.gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens,
                                                 scale, output_final_state, group_name(group),
                                                 strategy, use_qk_l2norm_in_kernel)
    return _ret(o, f, output_final_state)


def hgrn(x, g, *, initial_state=None, output_final_state=False, cu_seqlens=None, group=None,
         strategy="auto"):
    """:func:`forge_dist.ops.hgrn` as the custom op ``forge_dist::hgrn``."""
    o, f = torch.ops.forge_dist.hgrn(x, g, initial_state, cu_seqlens, output_final_state,
                                     group_name(group), strategy)
    return _ret(o, f, output_final_state)

"""The ops' short path: a call on one GPU runs a cached plan.

A forward that needs no gradient, on one device (``group=None``), without ``cu_seqlens``,
does not need the runner, the autograd function or the cross-rank checks: the plan of that
call signature (:mod:`forge_dist.runtime.cache`) checks its tensors and launches the same
kernels.  At T = 1K-8K the ops path costs 240-380 us of host time per call on an H200
against ~20 us for a plan (``scaling_benchmarks/results/launch_overhead_*``), which is what
inference and evaluation loops pay.  Calls with gradients take it too: the backward is one
more planned program (:meth:`forge_dist.runtime.plan.Plan.run_backward`), on hgrn's kept
outputs (its states) or on the matrix-state ops' kept inputs (the backward kernels recompute
the chunk states, as the general path's do), so a training step at short sequences pays a
few launches instead of the runner's autograd: at T = 1K-2K on an H100 one forward + backward
took 1.5-2.7 ms through the runner and 0.48-1.2 ms planned, against 0.09-0.82 ms of GPU time
(``scaling_benchmarks/results/train_overhead_*_s28-front.json``).

With a group, every op (:func:`forge_dist.runtime.sp_setup.sp_variants`) takes the same
path for a forward: it runs the rank's plan; a call with gradients runs the plan's training
run and backward (:mod:`forge_dist.runtime.sp_train`).

Anything else (varlen, fp16 and fp64 inputs, non-contiguous
tensors, the DSL's fused prologues with gradients, ``FORGE_DIST_CHECK_FINITE=1``, head dims
outside the kernels' range) takes the general path, as does a call the planner refuses.  Plans are
cached per CUDA stream and per thread (a plan's workspaces and launch parameter buffers are
reused by every run, so two streams or two threads must not share one).  Inside a CUDA
graph capture (``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``: the forward and
the planned backward are captured) a call gets a captured plan, kept apart from the LRU for
the graph's replays (``forge_dist.runtime.cache``); the front is skipped there.
``FORGE_DIST_OPS_PLANS=0`` turns the short path off.  Results match the general path to
fp32 rounding (both run the Triton kernels; the plan may split the sequence into segments
differently), not bit for bit.

The front (:func:`front`): the checks above, the plan-cache key and the op's own argument
checks cost more host time than the plan's run (s26, ``launch_overhead``: ``ops`` against
``static``).  So a call whose exact signature (every tensor's shape and dtype, the device,
the stream, the scalar arguments, the three environment switches and whether autograd will
differentiate it) an earlier call resolved to a plan goes straight to that plan's ``run``
(or, with gradients, the op's autograd function over the plan), which checks each tensor against
the plan as always; a refusal there (``PlanError``, raised before any launch that reads
the refused tensor or writes a caller's) sends the call down the full path, which gives the
op's own error or runs it another way.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
from threading import get_ident
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import summary_precision
from ..runtime import cache as plan_cache
from ..runtime.plan import PlanError
from ..runtime.sp_setup import sp_variants
from ..sp.agreement import group_key
from ..variants import registry
from ..variants.transitions import Kind
from .checks import check_finite_enabled
from .runner import needs_grad

_DTYPES = (torch.bfloat16, torch.float32)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index: int) -> int:
    """The current CUDA stream's handle (what Triton's launcher reads; cheap)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def enabled() -> bool:
    """``FORGE_DIST_OPS_PLANS`` (``1`` default, ``0`` off)."""
    raw = os.environ.get("FORGE_DIST_OPS_PLANS", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"FORGE_DIST_OPS_PLANS: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _eligible(inputs: Dict[str, Tensor], initial_state: Optional[Tensor], state_shape,
              group, cu_seqlens, use_kernels: bool, grads: bool = False,
              sp_plan: bool = False) -> bool:
    """Whether the short path takes this call; ``grads``: it can differentiate it;
    ``sp_plan``: the op has sequence-parallel plans, so a group is fine."""
    if cu_seqlens is not None or not use_kernels or not enabled():
        return False
    if group is not None and not sp_plan:
        return False
    if _compiling():  # a plan object and its host-side launches are not for tracing
        return False
    if check_finite_enabled():
        return False
    tensors = list(inputs.values()) + ([initial_state] if initial_state is not None else [])
    if not grads and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if not all(t.is_contiguous() for t in tensors):
        return False
    if initial_state is not None and (initial_state.dtype != torch.float32
                                      or tuple(initial_state.shape) != state_shape):
        return False
    return True


# call signature -> plan cache key, filled by calls the short path ran (see the docstring)
_FRONT: Dict[Tuple, Tuple] = {}


def _drop_plans() -> None:
    """At exit, before the interpreter tears modules down: sequence-parallel plans hold their
    process group, and a group still alive then makes gloo abort the process."""
    _FRONT.clear()
    plan_cache.clear()


atexit.register(_drop_plans)
# every switch the short path's eligibility reads: part of the signature, so that a change
# sends the next call down the full path, which decides afresh
_FRONT_ENV = ("FORGE_DIST_OPS_PLANS", "FORGE_DIST_KERNELS", "FORGE_DIST_CHECK_FINITE",
              "FORGE_DIST_DENSE_SUMMARY")
# os.environ.get encodes its key and goes through the Mapping machinery: 0.8 us per switch
# on the CPU, a sixth of the front.  The dict os.environ keeps (CPython's ``_data``, kept in
# step by every os.environ assignment) read with pre-encoded keys gives the same values.  It
# is looked up per call: a test may replace os.environ itself (then: the public way).
_ENV_KEYS = tuple(getattr(os.environ, "encodekey", lambda n: n)(n) for n in _FRONT_ENV)


def _switches() -> Tuple:
    data = getattr(os.environ, "_data", None)
    if type(data) is dict:
        return (data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]), data.get(_ENV_KEYS[2]),
                data.get(_ENV_KEYS[3]))
    get = os.environ.get
    return get(_FRONT_ENV[0]), get(_FRONT_ENV[1]), get(_FRONT_ENV[2]), get(_FRONT_ENV[3])


def front(op: str, tensors: Tuple[Tensor, ...], *, initial_state, output_final_state,
          scale=None, strategy="auto", group=None) -> Tuple[Optional[Tuple], Optional[tuple]]:
    """``(signature, result)``: ``result`` is the op's ``(o, final_state)`` when an earlier
    call of this exact signature ran on a plan, else ``None``; ``signature`` (``None`` when
    the front cannot take such a call) goes to :func:`matrix_call` / :func:`hgrn_call`,
    which remember it when they run the call on a plan.

    Args:
        tensors: the op's tensor inputs in the plan's order (``q, k, v[, g][, beta]`` or
            ``x, g``); the caller passes only calls without ``cu_seqlens``, a group or
            arguments the plans do not take (``g_gamma``, in-kernel l2 norm).
        group: a process group for the ops with sequence-parallel plans
            (:func:`forge_dist.runtime.sp_setup.sp_variants`), forward calls only.  A repeated
            call then runs its plan with no collective and no host synchronisation: the
            ranks agreed on the signature when the plan was made, and the signature word
            travels with the state (:mod:`forge_dist.sp.agreement`).  With gradients (the
            ops with training plans), the plan's training run
            (:mod:`forge_dist.runtime.sp_train`).
    """
    if _compiling():  # torch.compile / export trace the full path, as they always did
        return None, None
    for t in tensors:
        if type(t) is not Tensor:  # None, a subclass, anything else: the full path checks
            return None, None
    if initial_state is not None and type(initial_state) is not Tensor:
        return None, None
    first = tensors[0]
    grad = torch.is_grad_enabled() and (any([t.requires_grad for t in tensors]) or (
        initial_state is not None and initial_state.requires_grad))
    index = first.get_device()
    if index >= 0 and torch.cuda.is_current_stream_capturing():
        return None, None
    if scale is not None and type(scale) not in (float, int):
        return None, None  # a tensor scale may change in place: the full path reads it
    key = (op, tuple([t.shape for t in tensors]), tuple([t.dtype for t in tensors]), index,
           _raw_stream(index) if index >= 0 else 0, get_ident(), initial_state is None,
           output_final_state, scale, strategy, _switches(), grad,
           None if group is None else group_key(group))
    try:
        plan_key = _FRONT.get(key)
    except TypeError:  # an unhashable scale or strategy: the full path checks it
        return None, None
    if plan_key is None:
        return key, None
    p = plan_cache.lookup(plan_key)
    if p is None:  # evicted
        return key, None
    try:
        if grad:  # the op's autograd function over this plan, as the first call made it
            return key, _differentiable(p, tensors, initial_state)
        return key, p.run(*tensors, initial_state=initial_state)
    except PlanError:
        return key, None


def signatures_on_plans() -> int:
    """How many call signatures ran on a plan (and so go straight to it next time) since
    :func:`forget_signatures`: a benchmark reads it to say which path it timed."""
    return len(_FRONT)


def forget_signatures() -> None:
    """Drop the remembered signatures (the plans stay cached): each signature's next call
    takes the full path once, and is remembered again if it runs on a plan."""
    _FRONT.clear()


def _remember(front_key: Optional[Tuple], p) -> None:
    k = getattr(p, "cache_key", None)
    if front_key is not None and k is not None and k[-1] != plan_cache.CAPTURED:
        if len(_FRONT) >= 4 * max(1, plan_cache.maxsize()):
            _FRONT.clear()
        _FRONT[front_key] = p.cache_key


def _plan(op: str, initial_state, output_final_state, maps=None, **plan_kw):
    """The cached plan of this call, or ``None`` where the planner refuses it.  ``maps``:
    fused prologues (input name -> jitted map), keyed as sorted items."""
    if maps:
        plan_kw["maps"] = tuple(sorted(maps.items()))

    device = plan_kw["device"]
    stream = _raw_stream(device.index) if device.type == "cuda" else 0
    try:
        # inside a CUDA graph capture: a captured plan (runtime/cache.py), kept for the
        # graph's replays and never handed to an eager call
        return plan_cache.get(op, stream=stream, thread=get_ident(), captured=_capturing(device),
                         initial_state=initial_state is not None,
                         output_final_state=bool(output_final_state), **plan_kw)
    except PlanError:
        return None  # a shape or dtype the planner does not cover: the general path runs it


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _run(op: str, names, inputs: Dict[str, Tensor], initial_state, output_final_state,
         maps=None, front_key=None, **plan_kw) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    p = _plan(op, initial_state, output_final_state, maps, **plan_kw)
    if p is None:
        return None
    try:
        out = p.run(*[inputs[n] for n in names], initial_state=initial_state)
    except PlanError:  # e.g. a cubin plan and a contiguous tensor off 16-byte alignment:
        return None    # refused before any launch that reads it; the general path runs it
    if not maps:
        _remember(front_key, p)
    return out


class _PlannedHgrn(torch.autograd.Function):
    """hgrn through a plan, differentiable: the forward keeps ``g``, the outputs (the
    states ``h``) and the initial state; the backward runs the plan's backward program."""

    @staticmethod
    def forward(ctx, p, x, g, initial_state):
        o, final = p.run(x, g, initial_state=initial_state)
        ctx.plan = p
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(g, o, initial_state)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        g, o, h0 = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else _plan_ready(do, o.dtype)
        if dht is not None:
            dht = _plan_ready(dht, torch.float32)
        dx, dg, dS = ctx.plan.run_backward(g, o, do, dht=dht, initial_state=h0,
                                           need_initial_grad=ctx.needs_input_grad[3])
        return None, dx, dg, dS


class _PlannedMatrix(torch.autograd.Function):
    """A matrix-state op through a plan, differentiable: the forward keeps the inputs (and
    the initial state); the backward runs the plan's backward program, which recomputes the
    chunk states from them (:meth:`forge_dist.runtime.plan.Plan.run_backward`)."""

    @staticmethod
    def forward(ctx, p, initial_state, *inputs):
        o, final = p.run(*inputs, initial_state=initial_state)
        ctx.plan = p
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(initial_state, *inputs)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        p = ctx.plan
        h0, *inputs = ctx.saved_tensors
        # autograd's gradients may be views or (rarely) another dtype: the plan takes its own
        do = (torch.zeros(p.out_shape, dtype=p.out_dtype, device=p.device) if do is None
              else _plan_ready(do, p.out_dtype))
        if dht is not None:
            dht = _plan_ready(dht, torch.float32)
        *grads, dS = p.run_backward(*inputs, do, dht=dht, initial_state=h0,
                                    need_initial_grad=ctx.needs_input_grad[1])
        return (None, dS, *grads)


class _PlannedSequenceParallel(torch.autograd.Function):
    """An op on one rank of a group through a training plan
    (:mod:`forge_dist.runtime.sp_train`): the forward keeps the inputs (hgrn: its gates
    and outputs) and the run's incoming state and transition; the backward runs the reverse
    chain and the shard's backward program.  Every rank must differentiate its call (the
    chain crosses ranks)."""

    @staticmethod
    def forward(ctx, p, initial_state, *inputs):
        o, final, kept = p.run_train(*inputs, initial_state=initial_state)
        ctx.plan, ctx.kept = p, kept
        ctx.set_materialize_grads(False)
        # rank 0 starts from the caller's initial state: saved through autograd, which then
        # refuses a backward after the caller changed it in place.  hgrn's backward reads
        # its gates and outputs (its states), not x: those are what it keeps
        kept_tensors = ((inputs[1], o) if registry.get(p.op).vector_state else inputs)
        ctx.save_for_backward(initial_state if p.rank == 0 else None, *kept_tensors)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        p = ctx.plan
        do = (torch.zeros(p.out_shape, dtype=p.out_dtype, device=p.device) if do is None
              else _plan_ready(do, p.out_dtype))
        if dht is not None:
            dht = _plan_ready(dht, torch.float32)
        h0, *inputs = ctx.saved_tensors
        kept = ctx.kept if h0 is None else dataclasses.replace(ctx.kept, S_in=h0)
        # the context keeps what it holds: a second backward (retain_graph) runs again
        *grads, dS = p.run_backward_train(*inputs, do, kept=kept, dht=dht,
                                          need_initial_grad=ctx.needs_input_grad[1])
        return (None, dS, *grads)


def _differentiable(p, tensors, initial_state):
    """``(o, final_state)`` of a call with gradients through plan ``p``'s autograd function."""
    if p.size > 1:
        return _PlannedSequenceParallel.apply(p, initial_state, *tensors)
    if registry.get(p.op).vector_state:
        return _PlannedHgrn.apply(p, *tensors, initial_state)
    return _PlannedMatrix.apply(p, initial_state, *tensors)


def _train(p, tensors, initial_state, front_key):
    """A call with gradients through plan ``p`` (``None``: no plan, or a refusal before any
    launch that reads the refused tensor: the caller runs the general path)."""
    if p is None or p.backend == "torch":
        return None
    try:
        out = _differentiable(p, tensors, initial_state)
    except PlanError:
        return None
    _remember(front_key, p)
    return out


def _plan_ready(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a plan takes it: ``dtype``, contiguous and 16-byte aligned (cubins)."""
    if t.dtype is dtype and t.is_contiguous() and not t.data_ptr() & 15:
        return t  # the usual gradient: no conversion calls (~4 us of host time)
    t = t.to(dtype).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def matrix_call(op: str, q: Tensor, k: Tensor, v: Tensor, gates: Dict[str, Optional[Tensor]],
                *, scale: float, initial_state, output_final_state, cu_seqlens, group,
                use_kernels: bool, maps: Optional[dict] = None, front_key=None,
                strategy: str = "auto") -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``(o, final_state)`` through a cached plan, or ``None`` when the call is not eligible
    (the caller then runs the general path).  Arguments are already checked by the op.
    ``maps``: fused prologues of the DSL's lowered variants (input name -> jitted map).
    ``front_key``: the call's signature from :func:`front`, remembered if a plan runs it."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if q.dtype not in _DTYPES or not (16 <= K <= 256 and 16 <= V <= 256):
        return None
    present = {n: t for n, t in gates.items() if t is not None}
    if {t.dtype for t in present.values()} - {torch.float32, q.dtype}:
        return None
    inputs = {"q": q, "k": k, "v": v, **present}
    # the delta rule's plans walk the summary in the inputs' dtype:
    # FORGE_DIST_DENSE_SUMMARY=fp32 (fp32 copies) takes the general path
    sp_plan = not maps and op in sp_variants()
    if (sp_plan and registry.get(op).kind is Kind.DENSE and q.dtype != torch.float32
            and summary_precision() == "fp32"):
        sp_plan = False
    if not _eligible(inputs, initial_state, (B, H, K, V), group, cu_seqlens, use_kernels,
                     grads=not maps, sp_plan=sp_plan):
        return None
    names = ["q", "k", "v"] + [n for n in ("g", "beta") if n in present]
    kw = dict(B=B, T=T, H=H, K=K, V=V, dtype=q.dtype, scale=scale, device=q.device)
    if group is not None:
        train = needs_grad(inputs, initial_state)
        if train and _capturing(q.device):  # a captured training step: the general path
            return None
        kw.update(group=group, strategy=strategy, train=train)
    if registry.get(op).gate_optional:
        kw["gated"] = "g" in present
    if present:  # g and beta may differ (FLA's usual fp32 g with a bf16 beta)
        kw["gate_dtype"] = present.get("g", present.get("beta")).dtype
        if "beta" in present:
            kw["beta_dtype"] = present["beta"].dtype
    if needs_grad(inputs, initial_state):
        return _train(_plan(op, initial_state, output_final_state, **kw),
                      [inputs[n] for n in names], initial_state, front_key)
    return _run(op, names, inputs, initial_state, output_final_state, maps,
                front_key=front_key, **kw)


def hgrn_call(x: Tensor, g: Tensor, *, initial_state, output_final_state, cu_seqlens, group,
              use_kernels: bool, maps: Optional[dict] = None, front_key=None,
              strategy: str = "auto") -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """As :func:`matrix_call`, for ``hgrn`` (``x, g [B, T, D]``, state ``[B, D]``); with
    ``maps``, forward only (the planned backward takes the mapped gates).  With a group and
    gradients, a training plan (:mod:`forge_dist.runtime.sp_train`)."""
    B, T, D = x.shape
    # the gates may be kept in fp32 beside bf16 x (the plan's gate_dtype; dg comes in it)
    if x.dtype not in _DTYPES or g.dtype not in _DTYPES:
        return None
    inputs = {"x": x, "g": g}
    train = needs_grad(inputs, initial_state)
    if not _eligible(inputs, initial_state, (B, D), group, cu_seqlens, use_kernels,
                     grads=not maps, sp_plan=not maps):
        return None
    kw = {}
    if group is not None:
        if train and _capturing(x.device):  # a captured training step: the general path
            return None
        kw = {"group": group, "strategy": strategy, "train": train}
    p = _plan("hgrn", initial_state, output_final_state, maps, B=B, T=T, D=D, dtype=x.dtype,
              gate_dtype=g.dtype, device=x.device, **kw)
    if p is None:
        return None
    if train:
        return _train(p, (x, g), initial_state, front_key)
    try:
        out = p.run(x, g, initial_state=initial_state)
    except PlanError:  # as in _run
        return None
    if not maps:
        _remember(front_key, p)
    return out

"""The Triton work objects of the matrix-state patterns and their autograd glue.

:class:`TritonWork` (base of every pattern's work, a
:class:`~forge_dist.variants.base.SegmentWork`), :class:`DecayAttentionWork` (scalar and
per-channel decay), :class:`InputMap` (a fused prologue of one input) and the autograd
functions behind ``summary`` and ``finish``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional

import torch
from torch import Tensor

from . import scheduler
from .compat import ensure, grad_like, next_pow2
from ..variants import decay_attention
from ..variants.base import SegmentWork

if TYPE_CHECKING:  # the walker's kernels load when a pattern's work does, not with this base
    from .walker import SegmentStates


# --------------------------------------------------------------------------------------------
# Autograd glue.  Forward runs Triton; backward runs each pattern's Triton backward
# (``_finish_bwd`` / ``_summary_bwd``), or, where a work returns None there, recomputes
# through the PyTorch chunk form of forge_dist.variants.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputMap:
    """A fused elementwise prologue of one input: ``kernel``, the jitted tile map the
    templates take as a constexpr (:mod:`forge_dist.dsl.codegen`), and ``torch``, the same
    map in PyTorch, which the backward runs again and differentiates."""

    kernel: Callable
    torch: Callable


def _leaves(tensors, needs):
    out = []
    for t, n in zip(tensors, needs):
        if t is None:
            out.append(None)
        else:
            out.append(t.detach().requires_grad_(bool(n)))
    return out


def _grads(outputs, grad_outputs, inputs):
    pairs = [(o, go) for o, go in zip(outputs, grad_outputs) if o is not None and o.requires_grad]
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    result = {}
    if pairs and wanted:
        gs = torch.autograd.grad([p[0] for p in pairs],
                                 wanted, [p[1].to(p[0].dtype) for p in pairs], allow_unused=True)
        result = {id(x): gx for x, gx in zip(wanted, gs)}
    return [None if x is None else result.get(id(x)) for x in inputs]


class _FinishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, work, S_in, *tensors):
        ctx.work = work
        with torch.no_grad():
            out = work._finish_fwd(S_in, list(tensors))
        work.release()
        # a work whose outputs are its states (hgrn: o_t = h_t) keeps them for the backward
        # instead of recomputing them there (autograd refuses the backward if o is then
        # modified in place, as for any saved output)
        ctx.saved_output = work.backward_reads_output
        ctx.save_for_backward(S_in, *tensors, *((out[0],) if ctx.saved_output else ()))
        return out

    @staticmethod
    def backward(ctx, do, dht):
        S_in, *tensors = ctx.saved_tensors
        o = tensors.pop() if ctx.saved_output else None
        needs = ctx.needs_input_grad[1:]
        raw, tensors = ctx.work.remap(tensors)
        fast = (ctx.work._finish_bwd(S_in, tensors, do, dht, o=o) if ctx.saved_output else
                ctx.work._finish_bwd(S_in, tensors, do, dht))
        if fast is not None:  # Triton backward: [dS_in, *d tensors]
            fast = [fast[0], *ctx.work.chain(raw, tensors, fast[1:])]
            return (None, *[gr if n else None for gr, n in zip(fast, needs)])
        tensors = [t if r is None else r for t, r in zip(tensors, raw)]
        leaves = _leaves([S_in] + tensors, needs)
        with torch.enable_grad():
            o, ht = ctx.work._finish_torch(leaves[0], ctx.work.mapped_inputs(leaves[1:]))
            grads = _grads([o, ht], [do, dht], leaves)
        return (None, *grads)


class _SummaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, work, need_M, *tensors):
        ctx.work = work
        ctx.need_M = need_M
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            delta, M = work._summary_fwd(list(tensors), need_M)
        ctx.has_M = M is not None
        return (delta, M) if M is not None else (delta,)

    @staticmethod
    def backward(ctx, ddelta, dM=None):
        raw, tensors = ctx.work.remap(list(ctx.saved_tensors))
        fast = ctx.work._summary_bwd(tensors, ddelta, dM if ctx.has_M else None)
        if fast is not None:  # Triton backward: d tensors
            fast = ctx.work.chain(raw, tensors, fast)
            return (None, None, *[gr if n else None
                                  for gr, n in zip(fast, ctx.needs_input_grad[2:])])
        tensors = [t if r is None else r for t, r in zip(tensors, raw)]
        leaves = _leaves(tensors, ctx.needs_input_grad[2:])
        with torch.enable_grad():
            summ = ctx.work._summary_torch(ctx.work.mapped_inputs(leaves), ctx.need_M)
            outs = [summ.delta] + ([summ.transition] if ctx.has_M else [])
            gouts = [ddelta] + ([dM] if ctx.has_M else [])
            grads = _grads(outs, gouts, leaves)
        return (None, None, *grads)


class TritonWork(SegmentWork):
    """Base of the Triton-backed :class:`~forge_dist.variants.base.SegmentWork` objects.

    Subclasses set ``names`` (input tensor names in order) and implement ``_finish_fwd``
    (Triton, no grad), ``_summary_fwd`` (Triton, no grad) and ``_summary_torch`` (the
    PyTorch chunk form, used to recompute gradients).
    """

    names: tuple = ()
    vector_state = False
    keeps_segments = False  # _summary_fwd keeps segment states that _finish_fwd reuses
    backward_reads_output = False  # _finish_bwd takes finish's output o (keyword ``o``)

    def __init__(self, variant: str, inputs: dict, scale: Optional[float], need_transition: bool,
                 out_dtype: Optional[torch.dtype] = None, execution: Optional[str] = None,
                 maps: Optional[Dict[str, InputMap]] = None):
        self.variant = variant
        self.tensors = [inputs.get(n) for n in self.names]
        # fused prologues: the forward kernels map the raw inputs tile by tile; the backward
        # maps them again in PyTorch (remap) and chains the kernels' gradients through it
        self.input_maps = {n: m for n, m in (maps or {}).items() if m is not None}
        self.maps = {n: m.kernel for n, m in self.input_maps.items()}
        first = self.tensors[0]
        self.scale = first.shape[-1] ** -0.5 if scale is None else float(scale)
        self.in_dtype = first.dtype
        self.out_dtype = out_dtype or torch.float32
        self.execution_request = execution
        self.execution = None  # what the last finish() ran ("fused" / "decoupled")
        # the summary's segment states, kept by patterns whose finish() can reuse them
        self.segments: Optional[SegmentStates] = None

    # SegmentWork API ---------------------------------------------------------------------
    def summary(self, need_transition: bool):
        """``(delta [B, H, K, V] fp32, M or None)``; M by kind (see transitions.py)."""
        out = _SummaryFn.apply(self, bool(need_transition), *self.tensors)
        delta = out[0]
        M = out[1] if len(out) > 1 else None
        return delta, M

    def finish(self, S_in: Optional[Tensor]):
        """``(o, final state fp32)`` given the incoming state (``None``: zeros)."""
        return _FinishFn.apply(self, S_in, *self.tensors)

    def release(self) -> None:
        """Drop what ``summary``/``prepare`` kept for ``finish``: the autograd graph holds the
        work object until backward, which must not keep these buffers alive."""
        self.segments = None

    def prepare(self) -> None:
        """Compute and keep the segment states before the incoming state arrives (patterns
        that reuse them); gradients never flow through this (``finish`` recomputes them)."""
        if self.keeps_segments and self.segments is None:
            with torch.no_grad():
                self._summary_fwd([None if t is None else t.detach() for t in self.tensors],
                                  False)

    def _schedule(self, k: Tensor, v: Tensor, cfg: dict, gate_elems: int = 0,
                  with_summary: bool = False) -> int:
        """Pick FUSED or DECOUPLED (and the segment count) for this call; records the choice
        in ``execution`` / ``execution_reason`` / ``n_seg`` and returns the segment count.
        ``with_summary``: the shard's summary is needed too (sequence parallelism), so a
        fused run pays the summary's extra read of k and v as well."""
        B, T, H, K = k.shape
        V = v.shape[-1]
        s = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], next_pow2(V)),
                               elem_size=k.element_size(), gate_elems=gate_elems,
                               request=self.execution_request, with_summary=with_summary)
        self.execution, self.execution_reason, self.n_seg = s.strategy, s.reason, s.n_seg
        return s.n_seg

    # Fused prologues in the backward -------------------------------------------------------
    def _map_one(self, name: str, t: Tensor) -> Tensor:
        """``t`` through its prologue as the kernels compute it: in fp32, rounded to ``t``'s
        dtype for q, k, v, x; kept in fp32 for gates."""
        y = self.input_maps[name].torch(t.float())
        return y if name in ("g", "beta") else y.to(t.dtype)

    def mapped_inputs(self, tensors):
        """The inputs (in ``names`` order) through their prologues, differentiably."""
        return [t if t is None or n not in self.input_maps else self._map_one(n, t)
                for n, t in zip(self.names, tensors)]

    def remap(self, tensors):
        """``(leaves, mapped)`` for a backward: ``mapped`` are the prologues' outputs, which the
        Triton backward takes; ``leaves[i]`` the raw input they were computed from (``None``
        where the input has no prologue, ``mapped[i]`` is then the input itself)."""
        if not self.input_maps:
            return [None] * len(tensors), list(tensors)
        leaves, mapped = [], []
        for n, t in zip(self.names, tensors):
            if t is None or n not in self.input_maps:
                leaves.append(None)
                mapped.append(t)
                continue
            leaf = t.detach().requires_grad_(True)
            with torch.enable_grad():
                mapped.append(self._map_one(n, leaf))
            leaves.append(leaf)
        return leaves, mapped

    @staticmethod
    def chain(leaves, mapped, grads):
        """Gradients of the mapped inputs -> gradients of the raw inputs (``remap``'s pairs)."""
        pairs = [(i, g) for i, (x, g) in enumerate(zip(leaves, grads))
                 if x is not None and g is not None]
        out = [None if x is not None else g for x, g in zip(leaves, grads)]
        if pairs:
            got = torch.autograd.grad([mapped[i] for i, _ in pairs], [leaves[i] for i, _ in pairs],
                                      [g.to(mapped[i].dtype) for i, g in pairs])
            for (i, _), gx in zip(pairs, got):
                out[i] = gx
        return out

    # Backward ---------------------------------------------------------------------------------
    def _finish_bwd(self, S_in, tensors, do, dht):
        """Triton gradients ``[dS_in, *d tensors]`` of ``finish``, or ``None`` (recompute
        through the PyTorch chunk form)."""
        return None

    def _summary_bwd(self, tensors, ddelta, dM):
        """Triton gradients ``[*d tensors]`` of ``summary``, or ``None`` (PyTorch recompute)."""
        return None

    # PyTorch recompute used by backward ----------------------------------------------------
    def _finish_torch(self, S_in, tensors):
        summ = self._summary_torch(tensors, False)
        if S_in is None:
            return summ.o_zero, summ.delta
        o_part, s_part = summ.readout(S_in)
        return summ.o_zero + o_part, summ.delta + s_part

    def _summary_torch(self, tensors, need_M):  # pragma: no cover - abstract
        raise NotImplementedError

    def _finish_fwd(self, S_in, tensors):  # pragma: no cover - abstract
        raise NotImplementedError

    def _summary_fwd(self, tensors, need_M):  # pragma: no cover - abstract
        raise NotImplementedError


class DecayAttentionWork(TritonWork):
    """Base of the decay-attention works (scalar and per-channel decay): inputs
    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g`` or ``None``.  The backward is the
    subclass's chunk backward (``chunk_backward``, same signature for both patterns) for
    ``finish`` and the shared closed form for ``summary``."""

    names = ("q", "k", "v", "g")
    keeps_segments = True

    @staticmethod
    def chunk_backward(q, k, v, g, S_in, do, dht, scale):  # pragma: no cover - abstract
        """``(dq, dk, dv, dg, dS_in)`` of the pattern's recurrence."""
        raise NotImplementedError

    def _summary_segments(self) -> int:  # pragma: no cover - abstract
        """The segment count the summary would use (the scheduler's choice)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """As :meth:`TritonWork.prepare`, but only when the summary would run segments: with
        one, the finish walks from ``S_in`` and never reads the kept states, so computing them
        (a full read of k and v on the last rank) would be wasted."""
        if self.segments is None and self._summary_segments() == 1:
            return
        super().prepare()

    def summary(self, need_transition: bool):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in self.tensors):
            # Private aliases: autograd then meets the finish's and the summary's gradients
            # in the aliases' own nodes, which nothing else feeds, so the tensor the finish
            # returns is the one passed on (see _summary_bwd).  With the caller's tensors a
            # third consumer of k (or q is k) could make autograd sum into a new tensor.
            self.tensors = [None if t is None else t.view_as(t) for t in self.tensors]
            self._fuse_grads = True
        return super().summary(need_transition)

    def _finish_bwd(self, S_in, tensors, do, dht):
        q, k, v, g = (ensure(t) for t in tensors)
        dq, dk, dv, dg, dS = self.chunk_backward(
            q, k, v, g, None if S_in is None else S_in.to(torch.float32).contiguous(),
            None if do is None else do.contiguous(),
            None if dht is None else dht.to(torch.float32).contiguous(), self.scale)
        grads = [dS, dq, dk, dv, grad_like(dg, tensors[3])]
        task = torch._C._current_graph_task_id()
        self._finish_grads = None
        if getattr(self, "_fuse_grads", False) and getattr(self, "_summary_task", None) != task:
            # the summary's backward of this same backward pass (graph task) may add into these
            self._finish_grads = (task, tensors, grads[2:])
        return grads

    def _summary_bwd(self, tensors, ddelta, dM):
        """Closed form, no walk, one Triton kernel
        (:func:`.summary_backward.decay_summary_backward_triton`); q does not reach the
        summary (its gradient is ``None``: nothing to add to the finish's ``dq``).

        When the finish's backward ran first (the order of a sequence-parallel backward) and
        handed its ``dk, dv, dg`` over, the kernel adds into those tensors and this returns
        ``None`` for them: autograd still holds them for the consumer of k, v, g, which runs
        only after both nodes, and it skips a ``[B, T, H, K]`` sum per tensor (~1.5 ms of
        a rank's 13 ms at 4 x 32K tokens, ``results/sp_profile_*``)."""
        # lazy: backward-only Triton kernels, kept out of `import forge_dist.ops`
        from .summary_backward import accumulable, decay_summary_backward_triton

        q, k, v, g = tensors
        handed = getattr(self, "_finish_grads", None)
        self._finish_grads = None
        task = torch._C._current_graph_task_id()
        self._summary_task = task  # a finish backward after this one keeps nothing for it
        if (handed is not None and handed[0] == task
                and all(a is b for a, b in zip(handed[1], tensors))):
            target = handed[2]
            kc, vc, gc = (ensure(t) for t in (k, v, g))
            # accumulable() also means autograd passes them on as they are: the finish
            # returned them in k's, v's and g's shapes and dtypes (grad_like)
            if accumulable(target, kc, vc, gc):
                decay_summary_backward_triton(kc, vc, gc, ddelta, dM, accumulate_into=target)
                return [None, None, None, None]
        return [None, *decay_summary_backward_triton(k, v, g, ddelta, dM)]

    def _summary_torch(self, tensors, need_M):
        q, k, v, g = tensors
        return decay_attention.summarize(q, k, v, g, self.scale, need_transition=need_M)

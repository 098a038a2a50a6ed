"""A rank's whole sequence-parallel call as one autograd node, for a shard that is one piece
of one sequence (no ``cu_seqlens``) on the Triton kernels.

The runner's general form (:mod:`.runner`) differentiates the shard's summary ``(M, dS)``,
the state pass and the merge as separate nodes.  Its backward therefore runs the shard's
backward from ``S_in`` and, separately, the summary's: for the delta rule a second whole
backward over ``K + V`` value columns (the gradient of the dense ``M``), for the decay
patterns a closed form that reads k and v again.  None of it is needed: by linearity, rank
r's backward is the one-device backward of its shard started from ``S_in(r)`` with
``lam(r+1)`` as the gradient of its end state, and that backward's ``dh0`` is ``lam(r)``
(``docs/design.md`` section 7).  So this node's backward is:

1. ``lam_own``: the gradient of ``S_in(r)`` through this shard's outputs and final state
   alone (:func:`forge_dist.kernels.state_grad_program`: the reverse state walk, after the
   delta rule's WY factors, storing no chunk states); rank 0 skips it;
2. the strategy's reverse chain: ``lam(r+1)`` in, ``lam(r) = lam_own + M^T lam(r+1)`` out;
3. the shard's backward (the work's ``_finish_bwd``) from ``S_in(r)`` with
   ``dht = lam(r+1)`` (plus the returned final state's gradient).

The same steps as a training plan's (:mod:`forge_dist.runtime.sp_train`), for the calls
that have no plan: fp16 inputs and non-contiguous tensors, of every op (hgrn's too).  hgrn's
backward is its segments' reverse summaries (which need no ``lam(r+1)``), a reverse scan
over them, then the walk that writes the gradients
(:class:`forge_dist.kernels.vector_state.HgrnBackward`): ``lam_own`` is the scan alone, so
a rank's backward reads its inputs once, as on one device.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels
from ..kernels.compat import ensure, grad_like
from ..kernels.work import TritonWork
from ..sp import p2p, phases
from ..variants import transitions as tr
from ..variants.transitions import Kind


def takes(work) -> bool:
    """Whether :func:`run` can run this segment work: a Triton work with its own Triton
    backward and no fused prologues (a matrix state, or hgrn's vector state)."""
    return (isinstance(work, TritonWork) and not work.input_maps
            and type(work)._finish_bwd is not TritonWork._finish_bwd
            and (not work.vector_state or hasattr(work, "backward_steps")))


def _state_dims(work, tensors) -> Tuple[int, int, int, int]:
    """``(B, H, K, V)`` of the state in the runtime layout (hgrn: ``[B, 1, D, 1]``)."""
    first = tensors[0]
    if work.vector_state:
        B, _, D = first.shape
        return B, 1, D, 1
    B, _, H, K = first.shape
    return B, H, K, tensors[work.names.index("v")].shape[-1]


@lru_cache(maxsize=64)
def _state_grad(variant, B, T, H, K, V, dtype, has_dht, gated, scale, interp, sms, beta_dtype):
    return kernels.state_grad_program(variant, B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                                      has_dht=has_dht, gated=gated, scale=scale,
                                      interp=interp, sms=sms, beta_dtype=beta_dtype)


def _own_state_grad(work, tensors: List[Optional[Tensor]], do: Tensor,
                    dht: Optional[Tensor]) -> Tensor:
    """``lam_own [B, H, K, V]`` fp32: the incoming state's gradient through this shard."""
    t = dict(zip(work.names, tensors))
    q, v = t["q"], t["v"]
    B, T, H, K = q.shape
    g, beta = t.get("g"), t.get("beta")
    prog = _state_grad(work.variant, B, T, H, K, v.shape[-1], q.dtype, dht is not None,
                       g is not None, work.scale, kernels.interpreting(),
                       kernels.sm_count(q.device) if q.device.type == "cuda" else 132,
                       torch.float32 if beta is None else beta.dtype)
    given = {}
    for name, buf in prog.buffers.items():
        if buf.role != "input":
            continue
        x = {"do": do, "dht": dht}.get(name, t.get(name))
        given[name] = ensure(x.to(buf.dtype) if x.dtype != buf.dtype else x)
    return prog.execute(given, q.device)["dh0"]


class _ShardCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, work, kind, strategy, group, word, initial_state, *tensors):
        rank, size = p2p.rank_and_size(group)
        first = next(t for t in tensors if t is not None)
        B, H, K, V = _state_dims(work, tensors)
        opts = dict(dtype=torch.float32, device=first.device)
        tensors = list(tensors)
        with torch.no_grad():
            M = None
            if rank == size - 1:  # nobody reads the last rank's carry
                carry = torch.zeros(B, H, K, V, **opts)
            elif rank == 0 and initial_state is None:  # from zero: M is never applied
                carry, _ = work._summary_fwd(tensors, False)
                M = None if kind is Kind.IDENTITY else tr.zero(kind, B, H, K, **opts)
            else:
                carry, M = work._summary_fwd(tensors, True)
            work.prepare()
            S0 = (initial_state.to(torch.float32) if rank == 0 and initial_state is not None
                  else torch.zeros(B, H, K, V, **opts))
            phases.begin(phases.STATE_PASS)
            S_in, saved = strategy.forward_chain(kind, M, carry, S0, group, word)
            phases.end(phases.STATE_PASS)
            start = S_in if rank > 0 or initial_state is not None else None
            o, final = work._finish_fwd(start, tensors)
        work.release()
        ctx.work, ctx.kind, ctx.strategy, ctx.group, ctx.word = work, kind, strategy, group, word
        ctx.M, ctx.saved = M, saved
        ctx.set_materialize_grads(False)
        # hgrn's backward reads its states, which are its outputs
        ctx.save_for_backward(start, o if work.vector_state else None, *tensors)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        start, o, *tensors = ctx.saved_tensors
        work = ctx.work
        rank, size = p2p.rank_and_size(ctx.group)
        last = rank == size - 1
        first = next(t for t in tensors if t is not None)
        B, H, K, V = _state_dims(work, tensors)
        if do is None:
            do = torch.zeros(o.shape if work.vector_state else (*first.shape[:3], V),
                             dtype=work.out_dtype, device=first.device)
        dfinal = None if dfinal is None else dfinal.to(torch.float32).contiguous()
        tensors = [ensure(t) for t in tensors]
        steps = None
        if work.vector_state:  # hgrn: its segments' reverse summaries need no lam(r+1)
            steps = work.backward_steps(start, tensors, do.contiguous(), o)
            if rank > 0 or steps.n_seg > 1:  # rank 0's own lam is never read: one walk
                steps.summaries()
        if rank > 0:  # 1. this shard's own share of lam(r)
            lam_own = (steps.state_grad(dfinal).reshape(B, H, K, V) if steps is not None
                       else _own_state_grad(work, tensors, do, dfinal))
        else:  # rank 0 sends nothing back: its lam(0) comes from step 3
            lam_own = torch.zeros(B, H, K, V, dtype=torch.float32, device=first.device)
        with phases.BACKWARD_CHAIN:  # 2. lam(r+1) in, lam(r) out
            lam_next, _ = ctx.strategy.backward_chain(ctx.kind, ctx.M, lam_own, ctx.group,
                                                      ctx.saved, ctx.word)
        dht = dfinal if last else (lam_next if dfinal is None else lam_next + dfinal)
        # 3. the shard's backward from S_in(r) with its end state's gradient
        if steps is not None:
            dx, dg, dS = steps.finish(dht)
            grads = [dx, grad_like(dg, tensors[1])]
            dS = dS.reshape(B, H, K, V)
        else:
            dS, *grads = work._finish_bwd(start, tensors, do.contiguous(), dht)
        needs = ctx.needs_input_grad
        dS0 = dS if rank == 0 and needs[5] else None
        return (None, None, None, None, None, dS0,
                *[gr if n else None for gr, n in zip(grads, needs[6:])])


def run(work, kind: Kind, strategy, group, word: int, initial_state: Optional[Tensor]
        ) -> Tuple[Tensor, Tensor]:
    """``(o, final state)`` of one rank's shard (the work's inputs) with the state pass, as
    one autograd node.  ``initial_state``: rank 0's, internal layout, or ``None``."""
    return _ShardCall.apply(work, kind, strategy, group, word,
                            initial_state if p2p.rank_and_size(group)[0] == 0 else None,
                            *work.tensors)


__all__ = ["run", "takes"]

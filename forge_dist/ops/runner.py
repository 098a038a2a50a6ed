"""The rank-aware driver shared by every op: segments, local summaries, state pass, merge.

For one rank's shard ``[a, b)`` of the global sequence:

1. cut the shard into segments at packed-sequence boundaries (``cu_seqlens``);
2. summarise each segment locally (no communication): zero-state outputs, ``(M, dS)``;
3. pass states between ranks (:func:`forge_dist.sp.state_pass`) for the segment at the shard
   start, which continues a sequence begun on an earlier rank (on rank 0: from
   ``initial_state``);
4. merge each segment's incoming state into its outputs and final state.

Every rank calls the state pass exactly once per op call, whatever its segments look like,
so the communication pattern never depends on the data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import sp
from ..sp import p2p, phases
from ..variants import transitions as tr
from ..variants.base import SegmentWork, VariantSpec
from ..variants.transitions import Kind
from . import checks, shard_call


@dataclass(frozen=True)
class Segment:
    """Tokens ``[lo, hi)`` of the local shard, all of packed sequence ``seq``."""

    seq: int
    lo: int
    hi: int
    continues: bool  # its incoming state comes through the state pass
    ends_here: bool  # the sequence's last token is in this shard


def plan_segments(cu: Optional[List[int]], rank: int, T_local: int) -> List[Segment]:
    """Segments of rank ``rank``'s shard ``[rank*T_local, (rank+1)*T_local)``."""
    a, b = rank * T_local, (rank + 1) * T_local
    if cu is None:
        return [Segment(0, 0, T_local, True, True)]
    segs = []
    for n in range(len(cu) - 1):
        start, end = cu[n], cu[n + 1]
        if end <= a or start >= b:
            continue
        segs.append(Segment(n, max(start, a) - a, min(end, b) - a,
                            continues=(start < a) or (rank == 0 and start == 0),
                            ends_here=end <= b))
    return segs


def needs_grad(inputs: Dict[str, Optional[Tensor]], initial_state: Optional[Tensor]) -> bool:
    """Whether autograd will differentiate this call (checked to agree across ranks)."""
    tensors = [t for t in list(inputs.values()) + [initial_state] if t is not None]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def grad_anchor(inputs: Dict[str, Optional[Tensor]],
                initial_state: Optional[Tensor]) -> Optional[Tensor]:
    """A scalar hanging off every input that needs a gradient (``None`` if none does).

    The state pass depends on it, so the pass lies on the autograd path from the loss to
    any of those inputs on every rank, including the last, whose pass otherwise depends on
    nothing differentiable.
    """
    if not torch.is_grad_enabled():
        return None
    tensors = [t for t in list(inputs.values()) + [initial_state]
               if t is not None and t.requires_grad]
    if not tensors:
        return None
    return torch.stack([t.reshape(-1)[:1].sum().to(torch.float32) for t in tensors]).sum()


class _Attach(torch.autograd.Function):
    """Return ``x`` unchanged but make ``anchor`` part of its graph (zero gradient).

    Keeps the state pass in every rank's backward graph even where no output reads the
    incoming state (a sequence that starts exactly at the shard start), so the reverse chain
    never waits on a rank that skipped it.
    """

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def run(spec: VariantSpec, inputs: Dict[str, Optional[Tensor]],
        make_work: Callable[[Dict[str, Optional[Tensor]], bool], SegmentWork],
        state_dims: Tuple[int, int, int], *, B: int, T_local: int,
        initial_state: Optional[Tensor], output_final_state: bool,
        cu: Optional[List[int]], group, strategy: sp.Strategy,
        out_dtype: torch.dtype, compute_dtype: torch.dtype,
        device: torch.device, word: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
    """Run one op on this rank's shard.

    Args:
        inputs: tensors with the token axis at dim 1 (sliced per segment); ``None`` allowed.
        make_work: ``(segment inputs, need_transition) -> SegmentWork``; the flag tells
            whether this segment's transition ``M`` will be asked for.
        state_dims: ``(H, K, V)`` of the internal state ``[rows, H, K, V]``.
        initial_state: internal layout, ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu``).
        word: the call's signature word (checked on the device by the state pass).
    Returns:
        ``(o [B, T_local, ...], final_state or None)`` in the internal state layout.
    """
    rank, size = p2p.rank_and_size(group)
    H, K, V = state_dims
    check_finite = checks.check_finite_enabled()
    tokens = tuple(inputs) + ("o",)
    if check_finite:  # before any local work or state pass: every rank raises together
        checks.finite("input", list(inputs.items()) + [("initial_state", initial_state)],
                      group, device, token_tensors=tokens, resets=("g",))  # g=-inf: a reset
    segments = plan_segments(cu, rank, T_local)
    kind = spec.kind if cu is None else tr.with_boundaries(spec.kind)
    rows = B if cu is None else 1
    opts = dict(dtype=compute_dtype, device=device)

    def init_for(seg: Segment) -> Optional[Tensor]:
        if initial_state is None:
            return None
        s = initial_state if cu is None else initial_state[seg.seq:seg.seq + 1]
        return s.to(compute_dtype)

    # Phase 1: local work; only a non-last rank's carry needs a summary and its M.
    need_carry = size > 1 and rank < size - 1
    tail = segments[-1]
    # Rank 0's tail that starts the sequence with no initial state starts from zero: its
    # carry is the summary's delta alone, nobody reads its M, and M's gradient
    # (lam(1) S_in(0)^T) is zero.  Skipping M saves a dense K x K walk for GDN.
    tail_from_zero = rank == 0 and initial_state is None and tail is segments[0]
    works = []
    for seg in segments:
        part = {k: (None if t is None else t[:, seg.lo:seg.hi]) for k, t in inputs.items()}
        works.append(make_work(part, need_carry and seg is tail and seg.continues
                               and not tail_from_zero))
    if (size > 1 and cu is None and not check_finite and needs_grad(inputs, initial_state)
            and shard_call.takes(works[0])):
        # one piece of one sequence on the kernels: the whole call is one autograd node,
        # whose backward needs no derivative of the summary (shard_call.py)
        o, final = shard_call.run(works[0], kind, strategy, group, word,
                                  init_for(segments[0]) if rank == 0 else None)
        return o.to(out_dtype), (final if output_final_state else None)
    done = {}  # segment index -> (o, final) for work finished before the state pass

    # Phase 2: the state pass carries the sequence open at the shard end to the next rank.
    if size == 1:  # nothing to pass: the head's incoming state is the initial state
        S_in = init_for(segments[0])
    else:
        M_rank = None
        if not need_carry:
            carry = torch.zeros(rows, H, K, V, **opts)  # nobody reads the last rank's carry
        elif tail.continues and tail_from_zero:
            carry, _ = works[-1].summary(False)
            M_rank = None if kind is Kind.IDENTITY else tr.zero(kind, rows, H, K, **opts)
        elif tail.continues:
            carry, M_tail = works[-1].summary(True)
            M_rank = tr.promote(spec.kind, kind, M_tail, rows, H, K, **opts)
        else:  # a sequence starts inside the shard: the carry does not depend on S_in
            done[len(segments) - 1] = works[-1].finish(init_for(tail))
            carry = done[len(segments) - 1][1]
            M_rank = tr.zero(kind, rows, H, K, **opts)
        S0 = init_for(segments[0]) if rank == 0 else None
        if S0 is None:
            S0 = torch.zeros(rows, H, K, V, **opts)
        for seg, work in zip(segments, works):  # local work that needs no incoming state
            if seg.continues:
                work.prepare()
        if check_finite:  # an overflow in the local summary, before it is passed on
            checks.finite("local summary", [("carry (shard state from a zero start)", carry),
                                            ("M (shard transition)", M_rank)], group, device)
        # named phase edges (forge_dist.sp.phases), calls rather than a with-block: the
        # runner is traced by torch.compile, which cannot enter a custom context manager
        phases.begin(phases.STATE_PASS)
        S_in = sp.state_pass(kind, M_rank, carry, S0, group, strategy,
                             anchor=grad_anchor(inputs, initial_state), word=word)
        phases.end(phases.STATE_PASS)

    # Phase 3: merge incoming states into outputs and final states.
    phases.begin(phases.MERGE)
    outputs, finals = [], {}
    for i, (seg, work) in enumerate(zip(segments, works)):
        o, final = (done[i] if i in done
                    else work.finish(S_in if seg.continues else init_for(seg)))
        outputs.append(o)
        if seg.ends_here or cu is None:
            finals[seg.seq] = final
    o = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    if size > 1 and not segments[0].continues:
        o = _Attach.apply(o, S_in)
    o = o.to(out_dtype)

    final_state = None
    if output_final_state:
        if cu is None:
            final_state = finals[0]
        else:
            zero = torch.zeros(1, H, K, V, **opts)
            final_state = torch.cat([finals.get(n, zero) for n in range(len(cu) - 1)],
                                    dim=0)
    phases.end(phases.MERGE)
    if check_finite:
        checks.finite("output", [("o", o), ("final_state", final_state)], group, device,
                      token_tensors=tokens)
    return o, final_state

"""``scan``: every rank's incoming state in ``ceil(log2 P)`` rounds of recursive doubling.

The summaries compose associatively (``docs/design.md`` section 2): the map of rank r's
shard is ``x -> M_r x + dS_r``, and two consecutive shards compose as
``(M2, d2) o (M1, d1) = (M2 M1, M2 d1 + d2)``.  Rank r's incoming state is the exclusive
prefix of those maps applied to the start (rank 0 folds ``S0`` into its own ``dS``, so every
prefix starts from zero and only its ``d`` part is read).  An exclusive prefix over P ranks
takes ``ceil(log2 P)`` rounds (Hillis-Steele): in round k each rank sends what it has
composed so far (``incl``: its own map and the ``2^k - 1`` before it) to rank ``r + 2^k`` and
composes what rank ``r - 2^k`` sent into both ``incl`` and ``acc`` (the maps before it only).
A round carries the map's ``M`` too, except for the identity kind (linear attention), whose
rounds carry the state alone.

The backward chain ``lam(r) = g_r + M_r^T lam(r+1)`` is the same scan in the other direction,
over the maps ``x -> M_r^T x + g_r``, from the last rank.

Against the chain (``serial``, ``forge``: ``P - 1`` hops on the last rank's path) this is
``ceil(log2 P)`` hops and ``2 ceil(log2 P)`` compositions per rank, each message a state and
its transition.

Where forge's transport runs (CUDA tensors with NVSHMEM, or the simulated transport of a
gloo group under Triton's interpreter) the rounds are GPU-initiated.  Identity, scalar and
diagonal transitions take every round in one launch (``forge.run_scan_rounds``): each
program holds a tile of ``incl`` and ``acc`` with their transitions' rows, puts ``incl``
to ``r + 2^k`` and composes what ``r - 2^k`` put, round after round in the kernel, with no
host step between rounds.  The dense kind (the delta rule, whose ``K x K`` transition mixes
a tile's rows) takes forge's kernel in its send-first mode per round and tensor (one
channel per round and direction, bounded and signature-checked waits), and the
compositions run as tensor ops on the stream.  Neither synchronises the host.
Elsewhere the rounds are batched host point-to-point transfers, stamped like ``serial``'s.
``FORGE_DIST_SCAN_ROUNDS=host`` takes the host rounds everywhere (every rank must see the
same value).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..variants import transitions as tr
from ..variants.transitions import Kind
from . import p2p
from .agreement import TRAILER, Stamp
from .base import Strategy, fold_segments, register, shard_transition


def transition_shape(kind: Kind, like: Tensor) -> Optional[Tuple[int, ...]]:
    """The shape of a transition for states shaped like ``like [B, H, K, V]``."""
    B, H, K, _ = like.shape
    return {Kind.IDENTITY: None, Kind.SCALAR: (B, H), Kind.DIAGONAL: (B, H, K),
            Kind.DENSE: (B, H, K, K)}[kind]


def _composes_later(p: int, span: int, size: int) -> bool:
    """Whether position ``p`` composes what it gets in the round of ``span`` into a later
    round's map (it receives again, or sends again): then that map's ``M`` is read."""
    return p - 2 * span >= 0 or p + 2 * span < size


def reads_own_transition(kind: Kind, pos: int, size: int) -> bool:
    """Whether :func:`exclusive_scan` at position ``pos`` of ``size`` reads its own map's
    ``M``: it does where it sends ``M`` to a position that reads it (a round that composes
    an arrival into what it sends later also sends to such a position).  Position 0's
    never (every prefix starts from zero), nor the last position's, nor any at two ranks:
    such a rank need not form its transition.  (With ``exclusive_scan``'s ``with_M``, which
    returns the composed transition, every position's would be read: not for that use.)"""
    if kind is Kind.IDENTITY or pos == 0:
        return False
    span = 1
    while span < size:
        dst = pos + span
        if dst < size and _composes_later(dst, span, size):
            return True
        span *= 2
    return False


def moves_only(kind: Kind, pos: int, size: int, zero_start: bool) -> bool:
    """Whether a plan's forward rounds at position ``pos`` of ``size`` are moves alone: no
    transition sent or received, at most one arrival, and nothing composed (position 0
    starting from zero sends its own summary every round, and at two ranks the last
    position receives once).  Such a rank's later calls replay the moves (:class:`_Moves`;
    the per-round path, which the dense kind takes: the others run in one launch)."""
    if pos == 0 and not zero_start:
        return False  # S0 is folded into its summary every call
    gated = kind is not Kind.IDENTITY
    span, arrivals = 1, 0
    while span < size:
        src, dst = pos - span, pos + span

        def reads_M(p: int) -> bool:  # as exclusive_scan's (with_M off)
            return gated and _composes_later(p, span, size)
        if dst < size and reads_M(dst):
            return False  # a transition travels
        if src >= 0:
            arrivals += 1
            # a second arrival is combined; one read with its M, or composed into what is
            # sent later, is not a move alone
            if arrivals > 1 or reads_M(pos) or pos + 2 * span < size:
                return False
        span *= 2
    return True


def exclusive_scan(kind: Kind, M: Optional[Tensor], d: Tensor, pos: int, size: int,
                   exchange, with_M: bool = False, zero_first: bool = True):
    """The ``d`` of the composition of the maps at positions ``0 .. pos - 1`` (zeros at
    position 0; ``None`` there with ``zero_first=False``, for a caller that does not read
    it), this rank holding position ``pos``'s map ``(M, d)``; ``M`` ``None`` where no
    round reads it (:func:`reads_own_transition`; composed as the identity, and sent as
    zeros by position 0, whose transition no prefix applies).
    ``with_M``: return ``(M, d)`` of that
    composition instead (``M`` ``None``: the identity, at position 0 or for the identity
    kind).

    ``exchange(k, src, dst, M, d, m_shape, recv_M)``: round ``k``'s transfers, this rank's
    ``d`` (and ``M`` unless ``None``) to position ``dst`` (if ``< size``) and ``(M, d)`` from
    position ``src`` (if ``>= 0``), returned (``None`` when nothing arrives; its ``M``
    ``None`` unless ``recv_M``); ``m_shape``: the kind's transition shape (``None`` for the
    identity).  A transition travels only to a position
    that reads it later (it composes another arrival or sends again, or ``with_M``): the
    last round, and every round at two ranks, carries the state alone."""
    m_shape = transition_shape(kind, d)
    incl_M, incl_d = M, d
    acc_M: Optional[Tensor] = None
    acc_d: Optional[Tensor] = None
    span, k = 1, 0

    def reads_M(p: int) -> bool:  # position p composes what it gets this round later on
        return m_shape is not None and (with_M or _composes_later(p, span, size))
    while span < size:
        src, dst = pos - span, pos + span
        sent_M = None
        if dst < size and reads_M(dst):  # an aggregate whose M no rank reads (position 0):
            sent_M = (torch.zeros(m_shape, dtype=d.dtype, device=d.device)  # zeros
                      if incl_M is None else incl_M.to(d.dtype))
        got = exchange(k, src, dst, sent_M, incl_d, m_shape, src >= 0 and reads_M(pos))
        if got is not None:
            r_M, r_d = got
            # what arrived comes before what this rank holds: x -> held(arrived(x))
            if acc_d is None:
                acc_M, acc_d = r_M, r_d
            else:
                acc_d = tr.combine(kind, acc_M, r_d, acc_d)
                acc_M = tr.compose(kind, acc_M, r_M)
            if pos + 2 * span < size:  # incl is sent again in a later round
                incl_d = tr.combine(kind, incl_M, r_d, incl_d)
                incl_M = tr.compose(kind, incl_M, r_M)
        span, k = span * 2, k + 1
    if acc_d is None and zero_first:
        acc_d = torch.zeros_like(d)
    return (acc_M, acc_d) if with_M else acc_d


def host_exchange(group, rank_at: Callable[[int], int], stamp: Stamp, what: str, size: int):
    """A round as one batch of host point-to-point transfers of ``[d | M | trailer]``."""
    def exchange(k, src, dst, M, d, m_shape, recv_M):
        n_d = d.numel()
        n_m = math.prod(m_shape) if recv_M else 0
        payload = out = None
        if src >= 0:
            payload = torch.empty(n_d + n_m + TRAILER, dtype=d.dtype, device=d.device)
        if dst < size:
            out = stamp.send(d.reshape(-1) if M is None else
                             torch.cat([d.reshape(-1), M.reshape(-1)]))
        p2p.exchange(out, rank_at(dst) if out is not None else -1, payload,
                     rank_at(src) if payload is not None else -1, group, what)
        if payload is None:
            return None
        got = stamp.receive(payload, rank_at(src), payload[:-TRAILER])
        return (got[n_d:].view(m_shape) if recv_M else None), got[:n_d].view_as(d)
    return exchange


class _KeptMove:
    """One round's move in a sequence-parallel plan (whose rounds, peers and word never
    change between calls): its own send and receive buffers, and the compiled kernel kept
    after its first GPU call (``forge._Relaunch``), so a repeated call costs a copy into the
    send buffer and a relaunch: no allocation, no Triton binding.  ``zero_copy``: ``held``
    is a buffer the plan keeps and rewrites every call (its program's summary): the move
    sends it as it is, with no copy ahead of the send."""

    def __init__(self, held: Tensor, zero_copy: bool = False):
        self.zero_copy = zero_copy and held.is_contiguous()
        self.sent = held if self.zero_copy else torch.empty_like(
            held, memory_format=torch.contiguous_format)
        self.into = torch.empty_like(self.sent, memory_format=torch.contiguous_format)
        self.launch = None

    def fits(self, held: Tensor, zero_copy: bool = False) -> bool:
        if self.zero_copy != (zero_copy and held.is_contiguous()):
            return False
        if self.zero_copy and held.data_ptr() != self.sent.data_ptr():
            return False  # another buffer: the kept launch is bound to the old one
        return held.shape == self.sent.shape and held.dtype == self.sent.dtype

    def __call__(self, group, key: str, held: Tensor, src: int, dst: int, word: int) -> Tensor:
        if dst >= 0 and not self.zero_copy:
            self.sent.copy_(held)
        if self.launch is not None and self.launch.usable():
            self.launch()
        else:
            spot: dict = {}
            _launch_move(group, key, self.sent, self.into, src, dst, word, spot)
            self.launch = spot.get("launch")
        return self.into


class _Moves:
    """A plan's forward rounds on a rank whose rounds are moves alone (:func:`moves_only`),
    kept after the first call: each round's kept move with the arguments it took, replayed
    in order without the rounds' bookkeeping (the host's share of a short call).  Usable
    until a forge reset, whose channels every rank then allocates again in the full path."""

    def __init__(self, moves, result: Optional[_KeptMove]):
        from . import forge  # optional: forge needs Triton (on_device found it importable)

        self.moves, self.result, self.resets = moves, result, forge._RESETS
        self.calls = 0  # replays so far (tests)

    def usable(self) -> bool:
        from . import forge  # optional: forge needs Triton (on_device found it importable)

        # FORGE_DIST_SCAN_ROUNDS=host sends every rank down the host rounds (on_device)
        return (self.resets == forge._RESETS
                and os.environ.get("FORGE_DIST_SCAN_ROUNDS", "auto") != "host")

    def __call__(self, S0: Tensor) -> Tensor:
        for kept, args in self.moves:
            kept(*args)
        self.calls += 1
        return S0 if self.result is None else self.result.into


def _launch_move(group, key: str, held: Tensor, into: Tensor, src: int, dst: int, word: int,
                 keep: Optional[dict] = None) -> None:
    from . import forge  # optional: forge needs Triton (on_device found it importable)

    forge._run_chain(forge._where(group), key, Kind.IDENTITY, None, None, held, into, None,
                     forge._SRC_RECV if src >= 0 else forge._SRC_ZERO, dst >= 0, src, dst,
                     transpose=False, word=word, send_first=True, keep=keep)


def _allocated(keep: Optional[dict], key: str) -> bool:
    """Whether a plan's earlier call allocated channel ``key`` for a round that moves
    nothing on it, with no forge reset since (a reset drops every channel, and the next
    allocation is a collective every rank must join again)."""
    if keep is None or key not in keep:
        return False
    from . import forge  # optional: forge needs Triton (on_device found it importable)

    return keep[key] == forge._RESETS


def device_move(group, key: str, held: Tensor, src: int, dst: int, word: int,
                allocate: bool = True, keep: Optional[dict] = None,
                zero_copy: bool = False) -> Tensor:
    """``held`` to group rank ``dst`` and what group rank ``src`` sent on channel ``key``
    (``-1``: none; both ``-1``: only the channel is allocated, a collective every rank makes,
    and ``held`` comes back), by forge's kernel in its send-first mode.  ``held``:
    ``[B, H, K, V]``.

    ``keep``: a sequence-parallel plan's dict, where the move keeps its buffers and launch
    (:class:`_KeptMove`, under ``key``); what it returns is then its kept receive buffer,
    which the plan's next call rewrites (stream-ordered after this call's readers);
    ``zero_copy``: ``held`` is a buffer of the plan's own, sent without a copy
    (:class:`_KeptMove`)."""
    if src < 0 and dst < 0:
        if not _allocated(keep, key):
            from . import forge  # optional: forge needs Triton

            # (inside a CUDA graph capture the allocation raises, naming the warm-up call)
            forge._channel(forge._where(group), key, held, Kind.IDENTITY, allocate=allocate)
            if keep is not None:  # a later call of the plan skips it, until a forge reset
                keep[key] = forge._RESETS
        return held
    if keep is not None:
        kept = keep.get(key)
        if not isinstance(kept, _KeptMove) or not kept.fits(held, zero_copy):
            kept = keep[key] = _KeptMove(held, zero_copy)
        return kept(group, key, held, src, dst, word)
    into = torch.empty_like(held, memory_format=torch.contiguous_format)
    _launch_move(group, key, held.contiguous(), into, src, dst, word)
    return into


def as_state(M: Tensor) -> Tensor:
    """A transition as a ``[B, H, K, V]`` state for :func:`device_move` (V = 1 or K)."""
    return M.reshape(*M.shape, *(1,) * (4 - M.dim())).contiguous()


def device_exchange(group, rank_at: Callable[[int], int], word: int, channel: str,
                    size: int, keep: Optional[dict] = None, summary: Optional[Tensor] = None):
    """A round as forge's kernel in its send-first mode, one launch per tensor and one
    channel per round and tensor (``f"{channel}{k}"``, ``...-M``; see the module docstring).
    A rank idle in a round still allocates its channels (a collective).  ``keep``: a plan's
    dict for the moves' buffers and launches (:func:`device_move`); ``summary``: the plan's
    summary buffer, sent without a copy in a round that sends it as it is."""
    def exchange(k, src, dst, M, d, m_shape, recv_M):
        src_rank = rank_at(src) if src >= 0 else -1
        dst_rank = rank_at(dst) if dst < size else -1
        r_d = device_move(group, f"{channel}{k}", d, src_rank, dst_rank, word, keep=keep,
                          zero_copy=keep is not None and d is summary)
        r_M = None
        key = f"{channel}{k}-M"
        # every rank reaches the M channel (its allocation is a collective), moving M only
        # where it travels this round; a plan's later calls skip a channel that moves nothing
        if m_shape is not None and (recv_M or M is not None or not _allocated(keep, key)):
            kept = keep.get(key) if keep is not None else None
            if M is None and isinstance(kept, _KeptMove):
                held = kept.sent  # receive only: the shape is all a kept move reads
            else:
                held = as_state(M if M is not None else d.new_zeros(m_shape))
            moved = device_move(group, key, held, src_rank if recv_M else -1,
                                dst_rank if M is not None else -1, word, keep=keep)
            r_M = moved.view(m_shape) if recv_M else None
        return None if src < 0 else (r_M, r_d)
    return exchange


def on_device(group, like: Tensor) -> bool:
    """Whether forge's transport runs the rounds here (see the module docstring)."""
    choice = os.environ.get("FORGE_DIST_SCAN_ROUNDS", "auto")
    if choice not in ("auto", "host"):
        raise ValueError(f"FORGE_DIST_SCAN_ROUNDS: expected 'auto' or 'host', got {choice!r}")
    if choice == "host":
        return False
    try:
        from . import forge  # optional: forge needs Triton
    except Exception:  # noqa: BLE001 - no Triton: the host rounds
        return False
    if isinstance(group, forge.chan.SimRank):
        return False  # the one-process simulation runs ranks in order: no concurrent rounds
    if like.is_cuda:
        return forge.FORGE.available(like.device) is None
    return forge.interpreted() and dist.get_backend(group) == "gloo"


class Scan(Strategy):
    """``ceil(log2 P)`` rounds per direction; see the module docstring."""

    name = "scan"
    replays_moves = True  # a plan's rounds are exclusive_scan's (hier lays out its own)
    fused_rounds = True  # non-dense rounds on the device in one launch (hier: its own)
    # a plan's program keeps its segment summaries; the rounds kernel folds them (a launch
    # less on every rank before the last: a dense transition's program is folded anyway)
    plan_summary = "segments"

    def _scan(self, kind, M, d, pos, size, rank_at, group, word, direction, what, keep=None,
              zero_first=True, summary=None, log_m=False, plan=False, segments=False):
        """The exclusive prefix at position ``pos`` of ``size`` (group rank ``rank_at(p)``);
        ``keep``: a plan's dict for the device rounds' buffers and launches; ``zero_first``
        and ``summary`` as :func:`exclusive_scan`'s and :func:`device_exchange`'s.  On the
        device, identity, scalar and diagonal transitions take every round in one launch
        (``forge.run_scan_rounds``; ``log_m``: ``M`` is the log decays ``[B, H, K]``), a
        dense one a launch per round and tensor (:func:`device_exchange`).  ``plan``: a
        plan's forward, whose output buffer and launch are kept in ``keep`` (training calls
        get a fresh output: their backward reads it later); ``segments`` (the fused launch
        only): ``d`` and ``M`` are a plan's segment summaries and their log decays, folded in
        the kernel (``forge.run_scan_rounds``)."""
        if on_device(group, d) and kind is not Kind.DENSE:
            from . import forge  # optional: forge needs Triton (on_device found it importable)

            # a plan's forward keeps its output buffer and, where ``d`` is one the plan
            # rewrites in place, its launch (which binds its buffers)
            plan = plan and keep is not None
            out_key = f"scan-{direction}-out"
            out = keep.get(out_key) if plan else None
            shape = d.shape[1:] if segments else d.shape
            if out is None or out.shape != shape or out.dtype != d.dtype:
                out = torch.empty(shape, dtype=d.dtype, device=d.device)
                if plan:
                    keep[out_key] = out
            stable = plan and ((summary is not None and d is summary) or pos == size - 1)
            forge.run_scan_rounds(group, direction, kind, M, d, out, pos, size,
                                  tuple(rank_at(p) for p in range(size)), word,
                                  keep if stable else None, log_m, segments)
            return out if (pos > 0 or zero_first) else None
        if on_device(group, d):
            return exclusive_scan(kind, M, d, pos, size,
                                  device_exchange(group, rank_at, word, f"scan-{direction}-",
                                                  size, keep, summary), zero_first=zero_first)
        stamp = Stamp(group, word, d)
        out = exclusive_scan(kind, M, d, pos, size,
                             host_exchange(group, rank_at, stamp, what, size),
                             zero_first=zero_first)
        stamp.done()
        return out

    def _reads_own_transition(self, kind: Kind, rank: int, size: int) -> bool:
        """Whether this rank's forward rounds read its shard's transition."""
        return reads_own_transition(kind, rank, size)

    def plan_forward(self, kind, summaries, S0, S_in, group, word=0, keep=None,
                     zero_start=False):
        """A plan's forward pass (:meth:`.base.Strategy.plan_forward`) with nothing ahead of
        rank 0's first send that no rank reads: the shard's transition only where a round
        reads it (:func:`reads_own_transition`), ``S0`` folded into rank 0's summary only
        where it has one (``zero_start``: it starts from zero), no zero prefix for rank 0,
        and the program's summary sent from its own buffer (hier, whose rounds are laid out
        by node, copies it).  Where this rank's rounds are moves alone (:func:`moves_only`),
        the calls after the first replay them (:class:`_Moves`)."""
        moves = keep.get("scan-moves") if keep is not None else None
        if moves is not None and moves.usable():
            return moves(S0)
        rank, size = p2p.rank_and_size(group)
        if size == 1:
            return S0
        # scan's own rounds on the device, non-dense: one launch, which exponentiates the
        # plan's summed log decays itself (hier lays out its own rounds)
        fused = (self.fused_rounds and kind is not Kind.DENSE
                 and on_device(group, summaries.get("delta", summaries.get("hs", S0))))
        log_m = segments = False
        if rank < size - 1 and "delta" not in summaries:
            # a program that kept its segment summaries (plan_summary): the rounds kernel
            # folds them, as forge's chain kernel does; an initial state on rank 0, and the
            # host's rounds, take them folded here
            segments = fused and (rank > 0 or zero_start)
            if not segments:
                summaries = fold_segments(summaries)
        if rank == size - 1:  # the last rank only receives: nobody reads its carry
            M, d = None, S0
        elif segments:  # the kernel reads the log decays to fold the segments anyway
            d, M = summaries["hs"], summaries.get("gt")
        else:
            d = summaries["delta"]
            own = self._reads_own_transition(kind, rank, size)
            if fused and own and rank > 0:  # (position 0's own is never read)
                M, log_m = summaries["cg"][-1], True
            else:
                needs_M = (rank == 0 and not zero_start) or own
                M = shard_transition(kind, summaries, rank) if needs_M else None
            if rank == 0 and not zero_start:  # then every prefix starts from zero
                d = tr.combine(kind, M, S0, d)
                M = M if own else None  # (position 0's own is never read)
        out = self._scan(kind, M, d, rank, size, lambda p: p, group, word, "fwd",
                         f"the incoming state ({self.name})", keep, zero_first=rank > 0,
                         summary=summaries.get("hs" if segments else "delta"), log_m=log_m,
                         plan=True, segments=segments)
        if (keep is not None and self.replays_moves and not fused and on_device(group, d)
                and moves_only(kind, rank, size, zero_start)):
            keep["scan-moves"] = self._kept_rounds(keep, d, rank, size, group, word)
        return S0 if rank == 0 else out

    def _kept_rounds(self, keep: dict, d: Tensor, pos: int, size: int, group,
                     word: int) -> "_Moves":
        """The kept moves of this rank's forward rounds (:func:`moves_only` holds), in the
        order and with the arguments :func:`device_exchange` gave them."""
        moves, result, span, k = [], None, 1, 0
        while span < size:
            src, dst = pos - span, pos + span
            if src >= 0 or dst < size:
                key = f"scan-fwd-{k}"
                kept = keep[key]
                moves.append((kept, (group, key, d, src if src >= 0 else -1,
                                     dst if dst < size else -1, word)))
                if src >= 0:
                    result = kept
            span, k = span * 2, k + 1
        return _Moves(moves, result)

    def forward_chain(self, kind, M, delta, S0, group, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        if size == 1:
            return S0, None
        if 0 < rank < size - 1 and M is None and kind is not Kind.IDENTITY:
            raise ValueError(f"{self.name}: rank {rank} needs its transition M ({kind.value})")
        # rank 0 folds S0 into its map; then every prefix starts from zero
        d = tr.combine(kind, M, S0, delta) if rank == 0 else delta
        S_in = self._scan(kind, M, d, rank, size, lambda p: p, group, word, "fwd",
                          f"the incoming state ({self.name})", keep)
        return (S0 if rank == 0 else S_in), None

    def backward_chain(self, kind, M, grad_in, group, saved, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        if size == 1:
            return torch.zeros_like(grad_in), grad_in.clone()
        # lam(r) = g_r + M_r^T lam(r+1): the maps x -> M_r^T x + g_r, from the last rank
        Mt = M.transpose(-1, -2) if (kind is Kind.DENSE and M is not None) else M
        lam_next = self._scan(kind, Mt, grad_in, size - 1 - rank, size,
                              lambda p: size - 1 - p, group, word, "bwd",
                              f"the state gradient ({self.name})", keep)
        return lam_next, grad_in + tr.apply_transposed(kind, M, lam_next)


register(Scan())

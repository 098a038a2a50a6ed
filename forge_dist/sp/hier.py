"""``hier``: the log-depth scan laid out by node, so that few rounds leave a node.

The ranks of one node (a run of consecutive group ranks whose processes share a node,
:func:`forge_dist.sp.layout.nodes`) hold consecutive shards.  A rank's incoming state is its node's incoming state
carried through the shards of its node before it, so the pass splits in three:

1. **in the node** (NVLink): the exclusive scan of :mod:`.scan` over the node's maps gives
   each rank ``A_r``, the composition of the node's maps before its own (``M`` and ``d``);
2. **across nodes**: the last rank of each node composes its own map onto ``A_r`` (the
   node's total) and scans the totals with the other nodes' last ranks, which gives the
   state entering its node;
3. **back into the node**: that rank puts the state to each other rank of its node, which
   applies ``A_r`` to it.  The first node's incoming state is the start itself (rank 0 folds
   ``S0`` into its map, as in :mod:`.scan`), so it skips steps 2-3.

A rank's path is ``ceil(log2 L) + ceil(log2 N) + 1`` rounds for ``N`` nodes of ``L`` ranks, of
which ``ceil(log2 N)`` cross nodes (``scan`` over all ranks crosses nodes in every round once
``P > L``).  The backward chain runs the same way from the last rank, over the transposed
maps.  Rounds are GPU-initiated where :mod:`.scan`'s are (forge's kernel in its send-first
mode), batched host point-to-point transfers elsewhere.

The layout only decides speed, never the result: any partition into runs of consecutive
ranks gives the same states.
"""
from __future__ import annotations

import math
from typing import List, Optional, Set

import torch
from torch import Tensor

from ..variants import transitions as tr
from ..variants.transitions import Kind
from . import p2p
from .agreement import TRAILER, Stamp
from .base import register
from .layout import nodes
from .scan import (Scan, as_state, device_exchange, device_move, exclusive_scan,
                   host_exchange, on_device, transition_shape)


# ----------------------------------------------------------------------------- the pass
class _Route:
    """This rank's place in the three steps for one direction.

    ``members``: its node's group ranks in pass order; ``pos``: its index there;
    ``leaders``: each node's last rank in pass order (the node's total is there);
    ``node_pos``: its node's index in pass order."""

    def __init__(self, layout: List[List[int]], rank: int, reverse: bool):
        order = [list(reversed(m)) for m in reversed(layout)] if reverse else layout
        self.node_pos = next(i for i, m in enumerate(order) if rank in m)
        self.members = order[self.node_pos]
        self.pos = self.members.index(rank)
        self.leaders = [m[-1] for m in order]
        self.widest = max(len(m) for m in layout)

    @property
    def is_leader(self) -> bool:
        return self.pos == len(self.members) - 1


_ALLOCATED: Set[tuple] = set()


def _channels(group, route: _Route, d: Tensor, kind: Kind, direction: str):
    """Every channel of the device rounds, allocated in one order on every rank (allocation
    is a collective; ranks use different subsets of them); once per group, layout, state
    shape and forge reset."""
    from . import forge  # optional: forge needs Triton (on_device found it importable)

    m_shape = transition_shape(kind, d)
    key = (getattr(group, "group_name", None) or id(group), direction, route.widest,
           len(route.leaders), tuple(d.shape), d.dtype, str(d.device), m_shape,
           forge._RESETS)
    if key in _ALLOCATED:
        return
    capturing = d.is_cuda and torch.cuda.is_current_stream_capturing()
    m_like = None if m_shape is None else as_state(d.new_zeros(m_shape))
    for k in range(math.ceil(math.log2(route.widest))):
        for like, tag in ((d, ""), (m_like, "-M")):
            if like is not None:
                device_move(group, f"hier-{direction}-in{k}{tag}", like, -1, -1, 0,
                            allocate=not capturing)
    for k in range(math.ceil(math.log2(len(route.leaders)))):
        for like, tag in ((d, ""), (m_like, "-M")):
            if like is not None:
                device_move(group, f"hier-{direction}-x{k}{tag}", like, -1, -1, 0,
                            allocate=not capturing)
    for j in range(1, route.widest):
        device_move(group, f"hier-{direction}-out{j}", d, -1, -1, 0, allocate=not capturing)
    _ALLOCATED.add(key)


def _incoming(kind: Kind, M: Optional[Tensor], d: Tensor, route: _Route, group, word: int,
              direction: str, what: str, keep: Optional[dict] = None) -> Tensor:
    """The ``d`` of the composition of every map before this rank's in pass order
    (``M`` ``None``: the identity); ``keep``: a forward plan's dict for the device rounds'
    buffers and launches (:func:`.scan.device_move`)."""
    device = on_device(group, d)
    stamp = None
    if device:
        _channels(group, route, d, kind, direction)

        def exchange(members, channel):
            return device_exchange(group, lambda p: members[p], word, channel, len(members),
                                   keep)
    else:
        stamp = Stamp(group, word, d)

        def exchange(members, channel):
            return host_exchange(group, lambda p: members[p], stamp, what, len(members))
    # 1. in the node: A = the composition of the node's maps before this rank's
    A_M, A_d = exclusive_scan(kind, M, d, route.pos, len(route.members),
                              exchange(route.members, f"hier-{direction}-in"), with_M=True)
    # 2. the nodes' last ranks: each node's total (this rank's map after A), scanned across
    # the nodes; the first node's leader only sends (its node starts from zero)
    S_node = None
    if route.is_leader and len(route.leaders) > 1:
        total_d = tr.combine(kind, M, A_d, d)
        total_M = tr.compose(kind, M, A_M)
        S_node = exclusive_scan(kind, total_M, total_d, route.node_pos, len(route.leaders),
                                exchange(route.leaders, f"hier-{direction}-x"))
    if route.node_pos == 0:  # S0 is folded into rank 0's map: the first node starts at zero
        S_in = A_d
    else:
        # 3. the leader puts the state entering the node to the node's other ranks, which
        # carry it through A
        S_node = _share(S_node, d, route, group, word, direction, stamp, what, device, keep)
        S_in = tr.combine(kind, A_M, S_node, A_d)
    if stamp is not None:
        stamp.done()
    return S_in


def _share(S_node: Optional[Tensor], like: Tensor, route: _Route, group, word: int,
           direction: str, stamp: Optional[Stamp], what: str, device: bool,
           keep: Optional[dict] = None) -> Tensor:
    """Step 3: the node's last rank sends ``S_node`` to the node's other ranks; every rank
    returns it."""
    last = len(route.members) - 1
    if device:
        if route.is_leader:
            for j in range(1, last + 1):  # channel j: to the rank j places before the leader
                device_move(group, f"hier-{direction}-out{j}", S_node, -1,
                            route.members[last - j], word, keep=keep)
            return S_node
        return device_move(group, f"hier-{direction}-out{last - route.pos}", like,
                           route.members[last], -1, word, keep=keep)
    if route.is_leader:
        out = stamp.send(S_node)
        for j in range(1, last + 1):
            p2p.exchange(out, route.members[last - j], None, -1, group, what)
        return S_node
    payload = torch.empty(like.numel() + TRAILER, dtype=like.dtype, device=like.device)
    p2p.exchange(None, -1, payload, route.members[last], group, what)
    return stamp.receive(payload, route.members[last], like)


class Hier(Scan):
    """The scan in the node, across the nodes' last ranks, then back into the node; see the
    module docstring.  The chains are :class:`~.scan.Scan`'s (the backward from the last
    rank over the transposed maps); only the prefix is laid out by node."""

    name = "hier"
    replays_moves = False  # its rounds are laid out by node, not scan's
    fused_rounds = False
    plan_summary = "folded"  # its rounds take the shard's folded map

    def _scan(self, kind, M, d, pos, size, rank_at, group, word, direction, what, keep=None,
              zero_first=True, summary=None, log_m=False, plan=False, segments=False):
        # (log_m, segments: never, fused_rounds is off; plan: its kept moves are keyed by
        # round)
        # (the prefix of the first position is formed anyway: a first node's leader reads it)
        route = _Route(nodes(group), rank_at(pos), reverse=direction == "bwd")
        return _incoming(kind, M, d, route, group, word, direction, what, keep)

    def _reads_own_transition(self, kind, rank, size):
        # a node's leader composes its transition into the node's total: every rank past
        # the first keeps it (rank 0's map comes first, where every prefix starts from zero)
        return kind is not Kind.IDENTITY and 0 < rank < size - 1


register(Hier())

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
its transition.  The rounds here are host-issued point-to-point transfers, bounded and
stamped like ``serial``'s; a GPU-initiated version (puts with signals per tile, as forge's)
is not built yet.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..variants import transitions as tr
from ..variants.transitions import Kind
from . import p2p
from .agreement import TRAILER, Stamp
from .base import Strategy, register


def _m_shape(kind: Kind, like: Tensor) -> Optional[Tuple[int, ...]]:
    """The shape of a transition for states shaped like ``like [B, H, K, V]``."""
    B, H, K, _ = like.shape
    return {Kind.IDENTITY: None, Kind.SCALAR: (B, H), Kind.DIAGONAL: (B, H, K),
            Kind.DENSE: (B, H, K, K)}[kind]


def _exclusive_scan(kind: Kind, M: Optional[Tensor], d: Tensor, pos: int, size: int,
                    rank_at: Callable[[int], int], group, stamp: Stamp, what: str) -> Tensor:
    """The ``d`` of the composition of the maps at positions ``0 .. pos - 1`` (zeros at
    position 0), this rank holding position ``pos``'s map ``(M, d)``; ``M`` ``None`` is read
    as the identity (and where no later map reads it).  ``rank_at``: the rank at a position."""
    m_shape = _m_shape(kind, d)
    n_d = d.numel()
    n_m = 0 if m_shape is None else int(torch.Size(m_shape).numel())
    incl_M, incl_d = M, d
    acc_M: Optional[Tensor] = None
    acc_d: Optional[Tensor] = None
    dist = 1
    while dist < size:
        src, dst = pos - dist, pos + dist
        payload = out = None
        if src >= 0:
            payload = torch.empty(n_d + n_m + TRAILER, dtype=d.dtype, device=d.device)
        if dst < size:
            parts = [incl_d.reshape(-1)]
            if n_m:  # an aggregate whose M no rank reads (it holds position 0) sends zeros
                parts.append(torch.zeros(n_m, dtype=d.dtype, device=d.device)
                             if incl_M is None else incl_M.to(d.dtype).reshape(-1))
            out = stamp.send(torch.cat(parts))
        p2p.exchange(out, rank_at(dst) if out is not None else -1, payload,
                     rank_at(src) if payload is not None else -1, group, what)
        if payload is not None:
            got = stamp.receive(payload, rank_at(src), payload[:-TRAILER])
            r_d = got[:n_d].view_as(d)
            r_M = got[n_d:].view(m_shape) if n_m else None
            # what arrived comes before what this rank holds: x -> held(arrived(x))
            if acc_d is None:
                acc_M, acc_d = r_M, r_d
            else:
                acc_d = tr.combine(kind, acc_M, r_d, acc_d)
                acc_M = tr.compose(kind, acc_M, r_M)
            if pos + 2 * dist < size:  # incl is sent again in a later round
                incl_d = tr.combine(kind, incl_M, r_d, incl_d)
                incl_M = tr.compose(kind, incl_M, r_M)
        dist *= 2
    return torch.zeros_like(d) if acc_d is None else acc_d


class Scan(Strategy):
    """``ceil(log2 P)`` rounds per direction; see the module docstring."""

    name = "scan"

    def forward_chain(self, kind, M, delta, S0, group, word=0):
        rank, size = p2p.rank_and_size(group)
        if size == 1:
            return S0, None
        if 0 < rank < size - 1 and M is None and kind is not Kind.IDENTITY:
            raise ValueError(f"scan: rank {rank} needs its transition M ({kind.value})")
        stamp = Stamp(group, word, delta)
        # rank 0 folds S0 into its map; then every prefix starts from zero
        d = tr.combine(kind, M, S0, delta) if rank == 0 else delta
        S_in = _exclusive_scan(kind, M, d, rank, size, lambda p: p, group, stamp,
                               "the incoming state (scan)")
        stamp.done()
        return (S0 if rank == 0 else S_in), None

    def backward_chain(self, kind, M, grad_in, group, saved, word=0):
        rank, size = p2p.rank_and_size(group)
        if size == 1:
            return torch.zeros_like(grad_in), grad_in.clone()
        stamp = Stamp(group, word, grad_in)
        # lam(r) = g_r + M_r^T lam(r+1): the maps x -> M_r^T x + g_r, from the last rank
        Mt = M.transpose(-1, -2) if (kind is Kind.DENSE and M is not None) else M
        lam_next = _exclusive_scan(kind, Mt, grad_in, size - 1 - rank, size,
                                   lambda p: size - 1 - p, group, stamp,
                                   "the state gradient (scan)")
        stamp.done()
        return lam_next, grad_in + tr.apply_transposed(kind, M, lam_next)


register(Scan())

"""Host-pipelined ring: the state is cut into tiles, each tile hops on as soon as it is ready.

All receives are posted up front; the host loop waits for tile i, combines it and starts its
send, so tile i+1 crosses the link while tile i is combined.  Latency
``(P - 1 + n) x tile hop`` plus host work per tile.  The backward chain is the same ring run
from the last rank to the first with the transposed transitions (tiles of the dense kind run
along V, where ``M^T`` acts column by column).
"""
from __future__ import annotations


import torch

from ..config import env_positive_int
from ..variants import transitions as tr
from . import p2p
from .agreement import TRAILER, Stamp
from .base import Strategy, register


def n_tiles() -> int:
    """Tiles per state, from ``FORGE_DIST_PIPELINE_TILES`` (a positive integer, default 4)."""
    return env_positive_int("FORGE_DIST_PIPELINE_TILES", 4)


def _ring(kind, like, first, combine_tile, group, src, dst, what, stamp=None):
    """Receive ``like``-shaped tiles from ``src`` (or take ``first`` when there is no
    ``src``), and send ``combine_tile(tile)`` on to ``dst`` tile by tile.  Returns the
    whole received (or first) state.  With a :class:`Stamp`, every tile carries the call's
    signature trailer and is checked on arrival."""
    tiles = tr.tile_slices(kind, like.shape[-2], like.shape[-1], n_tiles())
    extra = 0 if stamp is None else TRAILER
    if src is None:
        received = first
    else:
        received = torch.empty_like(like)
        bufs = [like.new_empty(like[..., ks, vs].numel() + extra) for ks, vs in tiles]
        recvs = [p2p.irecv(b, src, group, f"{what} (tile {i} of {len(tiles)})")
                 for i, b in enumerate(bufs)]
    sends, outs = [], []
    for i, (ks, vs) in enumerate(tiles):
        if src is not None:
            p2p.wait(recvs[i], group, src, f"{what} (tile {i} of {len(tiles)})")
            shape = received[..., ks, vs]
            received[..., ks, vs] = (bufs[i].view_as(shape) if stamp is None
                                     else stamp.receive(bufs[i], src, shape))
        if dst is not None:
            out = combine_tile(ks, vs, received[..., ks, vs]).contiguous()
            outs.append(out if stamp is None else stamp.send(out))
            sends.append(p2p.isend(outs[-1], dst, group, f"{what} (tile {i} of {len(tiles)})"))
    for i, work in enumerate(sends):
        p2p.wait(work, group, dst, f"the send of {what} (tile {i} of {len(tiles)})")
    if stamp is not None:
        stamp.done()
    return received


class Pipelined(Strategy):
    """Tile-by-tile send/recv ring driven from the host."""

    name = "pipelined"

    def forward_chain(self, kind, M, delta, S0, group, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)

        def combine(ks, vs, S_tile):
            return tr.combine(kind, tr.slice_transition(kind, M, ks), S_tile, delta[..., ks, vs])
        S_in = _ring(kind, delta, S0, combine, group,
                     None if rank == 0 else rank - 1,
                     None if rank == size - 1 else rank + 1, "the incoming state",
                     Stamp(group, word, delta))
        return S_in, None

    def backward_chain(self, kind, M, grad_in, group, saved, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)

        def combine(ks, vs, lam_tile):
            M_t = tr.slice_transition(kind, M, ks)
            return grad_in[..., ks, vs] + tr.apply_transposed(kind, M_t, lam_tile)
        lam_next = _ring(kind, grad_in, torch.zeros_like(grad_in), combine, group,
                         None if rank == size - 1 else rank + 1,
                         None if rank == 0 else rank - 1, "the state gradient")
        return lam_next, grad_in + tr.apply_transposed(kind, M, lam_next)


register(Pipelined())

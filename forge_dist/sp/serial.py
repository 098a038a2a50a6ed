"""LASP-1 ring: rank r receives the whole state from r-1, combines, sends it to r+1."""
from __future__ import annotations

import torch

from ..variants import transitions as tr
from . import p2p
from .agreement import TRAILER, Stamp
from .base import Strategy, register


class Serial(Strategy):
    """``P x (hop + combine)`` latency, one state per rank and direction."""

    name = "serial"

    def forward_chain(self, kind, M, delta, S0, group, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        stamp = Stamp(group, word, delta)
        if rank == 0:
            S_in = S0
        else:
            payload = p2p.recv((delta.numel() + TRAILER,), delta.dtype, delta.device, rank - 1,
                               group, "the incoming state")
            S_in = stamp.receive(payload, rank - 1, delta)
        if rank < size - 1:
            out = stamp.send(tr.combine(kind, M, S_in, delta))
            p2p.wait(p2p.isend(out, rank + 1, group, "the state"), group, rank + 1,
                     "the state send")
        stamp.done()
        return S_in, None

    def backward_chain(self, kind, M, grad_in, group, saved, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        if rank == size - 1:
            lam_next = torch.zeros_like(grad_in)
        else:
            lam_next = p2p.recv(grad_in.shape, grad_in.dtype, grad_in.device, rank + 1, group,
                                "the state gradient")
        lam_here = grad_in + tr.apply_transposed(kind, M, lam_next)
        if rank > 0:
            p2p.wait(p2p.isend(lam_here, rank - 1, group, "the state gradient"), group,
                     rank - 1, "the gradient send")
        return lam_next, lam_here


register(Serial())

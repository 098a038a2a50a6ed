"""LASP-2 with decays and dense transitions: all-gather every rank's summary, fold locally.

Forward: rank 0 folds ``S0`` into its summary, every rank contributes ``(M_r, dS_r)`` to one
all-gather, and rank r folds the prefix ``s < r`` itself.  Backward: one all-gather of the
local state gradients ``g_s``, and each rank folds the suffix ``s > r`` with ``M_s^T``.
Volume per rank: ``P`` states (+ ``P`` transitions), latency one all-gather + ``P`` combines.
"""
from __future__ import annotations

import torch

from ..variants import transitions as tr
from ..variants.transitions import Kind
from . import p2p
from .agreement import TRAILER, Stamp
from .base import Strategy, register


def _pack(kind, M, delta, stamp):
    """One flat buffer per rank: ``[dS, M, trailer]`` (M left out for the identity kind)."""
    parts = [delta.reshape(-1)]
    if kind is not Kind.IDENTITY:
        parts.append(M.reshape(-1))
    return stamp.send(torch.cat(parts))


class Lasp2(Strategy):
    """All-gather of affine summaries, prefix fold on every rank."""

    name = "lasp2"

    def forward_chain(self, kind, M, delta, S0, group, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        stamp = Stamp(group, word, delta)
        if M is None and kind is not Kind.IDENTITY:  # the last rank's M is never read
            M = tr.zero(kind, *delta.shape[:2], delta.shape[2], dtype=delta.dtype,
                        device=delta.device)
        contribution = tr.combine(kind, M, S0, delta) if rank == 0 else delta
        gathered = p2p.all_gather(_pack(kind, M, contribution, stamp), group,
                                  "the forward state summaries (lasp2's all-gather)")
        # every peer's trailer is checked (a NaN row poisons this rank's fold)
        gathered = [row[:-TRAILER] if s == rank else stamp.receive(row, s, row[:-TRAILER])
                    for s, row in enumerate(gathered)]
        stamp.done()
        n = delta.numel()
        S = S0
        for s in range(rank):
            dS_s = gathered[s][:n].view_as(delta)
            if s == 0:
                S = dS_s
            else:
                M_s = None if kind is Kind.IDENTITY else gathered[s][n:].view_as(M)
                S = tr.combine(kind, M_s, S, dS_s)
        # Backward folds the suffix with the transitions gathered here.
        Ms = [None if kind is Kind.IDENTITY else g[n:].view_as(M) for g in gathered]
        return S, Ms

    def backward_chain(self, kind, M, grad_in, group, saved, word=0, keep=None):
        rank, size = p2p.rank_and_size(group)
        Ms = saved
        grads = p2p.all_gather(grad_in, group, "the state gradients (lasp2's all-gather)")
        lam = torch.zeros_like(grad_in)
        for s in range(size - 1, rank, -1):
            lam = grads[s] + tr.apply_transposed(kind, Ms[s], lam)
        lam_next = lam
        return lam_next, grad_in + tr.apply_transposed(kind, Ms[rank], lam_next)


register(Lasp2())

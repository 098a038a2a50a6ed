"""Chunk form of the vector-state recurrence (HGRN): ``h_t = exp(g_t) h_{t-1} + x_t``.

The state is ``h [B, D]``; the runtime stores it as ``[B, 1, D, 1]`` so that it is a
diagonal-kind state like every other.  Inside a chunk the recurrence runs token by token,
vectorised over all chunks at once (C steps), then the chunk summaries are scanned (NT steps):
with ``C ~ sqrt(L)`` that is about ``2 sqrt(L)`` vectorised steps.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import chunked as ck
from .base import SegmentSummary
from .transitions import Kind


def summarize(x: Tensor, g: Tensor, *, need_transition: bool,
              chunk_size: Optional[int] = None) -> SegmentSummary:
    """Local three-phase pass over one segment; ``x, g [B, L, D]``."""
    dtype = ck.compute_dtype(x)
    B, L, D = x.shape
    C = chunk_size or max(1, min(256, int(math.isqrt(L))))
    # [B, L, D] -> [B, 1, NT, C, D] via the shared chunker (one "head").
    xc = ck.to_chunks(x.to(dtype)[:, :, None], C)[:, 0]  # [B, NT, C, D]
    gc = ck.to_chunks(g.to(dtype)[:, :, None], C)[:, 0]
    h = torch.zeros_like(xc[:, :, 0])
    local = []
    for i in range(C):  # intra-chunk recurrence from a zero start, all chunks at once
        h = gc[:, :, i].exp() * h + xc[:, :, i]
        local.append(h)
    local = torch.stack(local, dim=2)  # [B, NT, C, D]
    Gc = gc.cumsum(dim=2)
    M_c = Gc[:, :, -1].exp()  # [B, NT, D]
    # Scan chunk summaries in the common [B, H=1, NT, K=D, V=1] layout.
    starts, delta = ck.scan_chunks(Kind.DIAGONAL, M_c[:, None], local[:, None, :, -1, :, None])
    o_zero = local + Gc.exp() * starts[:, 0, :, None, :, 0]
    o_zero = o_zero.reshape(B, -1, D)[:, :L]

    G_seg = g.to(dtype).cumsum(dim=1)

    M_seg = G_seg[:, -1].exp()[:, None]  # [B, 1, D]

    def readout(S_in: Tensor):
        return G_seg.exp() * S_in.reshape(B, 1, D), M_seg[..., None] * S_in

    M = M_seg if need_transition else None
    return SegmentSummary(o_zero, delta, M, readout)

"""Chunk form of the matrix-state variants with identity, scalar or vector (diagonal) decay.

One routine serves linear_attn (no gate), simple_gla (``g [B, L, H]``) and gla
(``g [B, L, H, K]``): per chunk, with ``G`` the in-chunk cumulative log decay,

    intra   o_i   = scale * sum_{j<=i} q_i^T (exp(G_i - G_j) * k_j) v_j^T
    summary dS_c  = sum_j (exp(G_C - G_j) * k_j) v_j^T,      M_c = exp(G_C)
    inter   o_i  += scale * (q_i * exp(G_i))^T S_c
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import chunked as ck
from . import transitions as tr
from .base import SegmentSummary
from .transitions import Kind


def summarize(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], scale: float, *,
              need_transition: bool, chunk_size: Optional[int] = None) -> SegmentSummary:
    """Local three-phase pass over one segment.

    Args:
        q, k: ``[B, L, H, K]``; v: ``[B, L, H, V]``.
        g: ``None`` (identity), ``[B, L, H]`` (scalar) or ``[B, L, H, K]`` (diagonal) log decays.
        scale: query scale.
    """
    dtype = ck.compute_dtype(q)
    B, L, H, K = q.shape
    vector = g is not None and g.dim() == 4
    kind = Kind.IDENTITY if g is None else (Kind.DIAGONAL if vector else Kind.SCALAR)
    # The vector form builds a [C, C, K] decay tensor per chunk: keep its chunks small.
    C = chunk_size or (16 if vector else 64)
    qc, kc, vc = (ck.to_chunks(t.to(dtype), C) for t in (q, k, v))  # [B, H, NT, C, D]
    if g is None:
        gc = torch.zeros(qc.shape[:4], dtype=dtype, device=q.device)
    else:
        gc = ck.to_chunks(g.to(dtype), C)  # [B, H, NT, C] or [B, H, NT, C, K]
    # in-chunk decays, exact through hard resets (g = -inf)
    Gc = ck.LogDecay(gc, dim=3)
    M_c = None if g is None else Gc.total()  # [B, H, NT] or [B, H, NT, K]
    if vector:
        # exp(G_i - G_j) per key dimension, masked before exp: [B, H, NT, C, C, K]
        D = ck.LogDecay(gc.movedim(-1, -2), dim=-1).matrix().movedim(-3, -1)
        A = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", qc, kc, D)
        q_in = qc * Gc.from_start()
        k_out = kc * Gc.to_end()
    else:
        A = (qc @ kc.transpose(-1, -2)) * Gc.matrix()
        q_in = qc * Gc.from_start()[..., None]
        k_out = kc * Gc.to_end()[..., None]
    o_intra = scale * (A @ vc)
    dS_c = k_out.transpose(-1, -2) @ vc  # [B, H, NT, K, V]
    starts, delta = ck.scan_chunks(kind, M_c, dS_c)
    o_zero = o_intra + scale * (q_in @ starts)

    # The incoming state decays by the cumulative gate from the segment start.
    if g is None:
        M_seg = None
        q_read = scale * q.to(dtype)
    else:
        G_seg = ck.LogDecay(g.to(dtype), dim=1)
        decay_in = G_seg.from_start()  # [B, L, H] or [B, L, H, K]
        q_read = scale * q.to(dtype) * (decay_in if vector else decay_in[..., None])
        M_seg = G_seg.total()  # [B, H] or [B, H, K]

    def readout(S_in: Tensor):
        o = torch.einsum("blhk,bhkv->blhv", q_read, S_in)
        return o, tr.apply(kind, M_seg, S_in)

    M = M_seg if need_transition else None
    return SegmentSummary(ck.from_chunks(o_zero, L), delta, M, readout)

"""Chunk form of the gated delta rule (dense transitions), in the WY representation.

Per chunk of C tokens, with ``G`` the in-chunk cumulative log decay and ``S_0`` the state at
the chunk start, the delta-rule corrections ``D = U - W S_0`` solve a unit lower-triangular
system (``Lmat_ij = exp(G_i - G_j) k_i^T k_j`` for ``j < i``)::

    (I + diag(b) Lmat) U = diag(b) V,    (I + diag(b) Lmat) W = diag(b exp(G)) K
    outputs   O   = A U + (scale * exp(G) Q - A W) S_0,   A_ij = scale exp(G_i - G_j) q_i^T k_j (j <= i)
    end state S_C = (exp(G_C) I - Kt^T W) S_0 + Kt^T U,    Kt = exp(G_C - G) K

so the chunk transition is the dense ``M_c = exp(G_C) I - Kt^T W`` (kept in fp32 or better).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import chunked as ck
from .base import SegmentSummary
from .transitions import Kind

#: the key normalisation's epsilon, inside the root as FLA's (``use_qk_l2norm_in_kernel``)
L2_EPS = 1e-6


def l2_normalize(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, computed in fp32 (fp64 for fp64
    inputs) and returned in ``x``'s dtype: FLA's form, which its GatedDeltaNet layers and
    ``use_qk_l2norm_in_kernel`` use (``x / max(|x|, eps)`` differs by about
    ``eps / (2 |x|^2)`` relative, 1.6e-3 in a freshly initialised layer's outputs)."""
    wide = x if x.dtype == torch.float64 else x.float()
    return (wide * torch.rsqrt((wide * wide).sum(-1, keepdim=True) + eps)).to(x.dtype)


def summarize(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor, scale: float,
              *, need_transition: bool, chunk_size: int = 32) -> SegmentSummary:
    """Local three-phase pass over one segment.

    Args:
        q, k: ``[B, L, H, K]``; v: ``[B, L, H, V]``; g: ``[B, L, H]`` log decays or ``None``
        (DeltaNet); beta: ``[B, L, H]``.
    """
    dtype = ck.compute_dtype(q)
    B, L, H, K = q.shape
    C = chunk_size
    qc, kc, vc = (ck.to_chunks(t.to(dtype), C) for t in (q, k, v))
    bc = ck.to_chunks(beta.to(dtype), C)  # [B, H, NT, C]
    # in-chunk decays, exact through hard resets (g = -inf)
    gc = torch.zeros_like(bc) if g is None else ck.to_chunks(g.to(dtype), C)
    Gc = ck.LogDecay(gc, dim=3)
    decay = Gc.matrix()  # [B, H, NT, C, C], i >= j
    from_start = Gc.from_start()  # exp(G) [B, H, NT, C]
    strict = ck.causal_mask(C, q.device, strict=True)

    Lmat = (kc @ kc.transpose(-1, -2)) * decay * strict
    system = torch.eye(C, dtype=dtype, device=q.device) + bc[..., None] * Lmat
    U = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False,
                                      unitriangular=True)
    W = torch.linalg.solve_triangular(system, (bc * from_start)[..., None] * kc, upper=False,
                                      unitriangular=True)
    A = scale * (qc @ kc.transpose(-1, -2)) * decay
    R = scale * from_start[..., None] * qc - A @ W  # readout of the chunk-start state [.., C, K]
    k_t = Gc.to_end()[..., None] * kc
    eye = torch.eye(K, dtype=dtype, device=q.device)
    M_c = Gc.total()[..., None, None] * eye - k_t.transpose(-1, -2) @ W  # [B,H,NT,K,K]
    dS_c = k_t.transpose(-1, -2) @ U

    starts, delta = ck.scan_chunks(Kind.DENSE, M_c, dS_c)
    o_zero = A @ U + R @ starts

    def readout(S_in: Tensor):
        # Carry S_in through the chunk transitions (the dense chain), read out per chunk.
        carried, end = ck.scan_chunks(Kind.DENSE, M_c, torch.zeros_like(dS_c), S_in)
        return ck.from_chunks(R @ carried, L), end

    M = ck.chain_transitions(Kind.DENSE, M_c) if need_transition else None
    return SegmentSummary(ck.from_chunks(o_zero, L), delta, M, readout)

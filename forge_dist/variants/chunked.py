"""Shared pieces of the PyTorch chunk-wise forms (the portable fallback on any device).

Layout inside: ``[B, H, NT, C, D]`` (NT chunks of C tokens).  Every function is plain
differentiable PyTorch, so autograd gives the backward pass.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import transitions as tr
from .transitions import Kind


def to_chunks(x: Tensor, C: int) -> Tensor:
    """``[B, L, H, *D] -> [B, H, NT, C, *D]``, zero-padding L up to a multiple of C."""
    B, L = x.shape[:2]
    NT = -(-L // C)
    pad = NT * C - L
    if pad:
        x = torch.cat([x, x.new_zeros((B, pad) + tuple(x.shape[2:]))], dim=1)
    x = x.reshape((B, NT, C) + tuple(x.shape[2:]))
    # [B, NT, C, H, *D] -> [B, H, NT, C, *D]
    return x.movedim(3, 1)


def from_chunks(x: Tensor, L: int) -> Tensor:
    """Inverse of :func:`to_chunks`: ``[B, H, NT, C, *D] -> [B, L, H, *D]``."""
    B, H, NT, C = x.shape[:4]
    x = x.movedim(1, 3).reshape((B, NT * C, H) + tuple(x.shape[4:]))
    return x[:, :L]


def causal_mask(C: int, device, *, strict: bool = False) -> Tensor:
    """``[C, C]`` boolean mask, True where ``i >= j`` (``i > j`` when strict)."""
    idx = torch.arange(C, device=device)
    return (idx[:, None] > idx[None, :]) if strict else (idx[:, None] >= idx[None, :])


def decay_matrix(Gc: Tensor, *, strict: bool = False) -> Tensor:
    """``exp(G_i - G_j)`` for ``i >= j`` (else 0) from in-chunk cumulative log decays.

    ``Gc [..., C]`` (scalar decay) gives ``[..., C, C]``; the difference is masked *before*
    the exponential so that ``i < j`` (a positive exponent) can never overflow.
    """
    C = Gc.shape[-1]
    diff = Gc[..., :, None] - Gc[..., None, :]
    mask = causal_mask(C, Gc.device, strict=strict)
    return torch.where(mask, diff, torch.full_like(diff, float("-inf"))).exp()


def scan_chunks(kind: Kind, M_c: Optional[Tensor], dS_c: Tensor,
                S0: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Phase 2 inside a segment: the state at the start of every chunk.

    Args:
        M_c: per-chunk transitions ``[B, H, NT, ...]`` (``None`` for identity).
        dS_c: per-chunk zero-start end states ``[B, H, NT, K, V]``.
        S0: incoming state ``[B, H, K, V]`` (zeros when ``None``).
    Returns:
        ``(starts [B, H, NT, K, V], end [B, H, K, V])``.
    """
    NT = dS_c.shape[2]
    S = torch.zeros_like(dS_c[:, :, 0]) if S0 is None else S0
    starts: List[Tensor] = []
    for c in range(NT):
        starts.append(S)
        M = None if M_c is None else M_c[:, :, c]
        S = tr.combine(kind, M, S, dS_c[:, :, c])
    return torch.stack(starts, dim=2), S


def chain_transitions(kind: Kind, M_c: Optional[Tensor]) -> Optional[Tensor]:
    """The transition of a whole segment, ``M_{NT-1} ... M_1 M_0``."""
    if M_c is None or kind is Kind.IDENTITY:
        return None
    if kind in (Kind.SCALAR, Kind.DIAGONAL):
        return M_c.prod(dim=2)
    out = M_c[:, :, 0]
    for c in range(1, M_c.shape[2]):
        out = M_c[:, :, c] @ out
    return out


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else computes in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32

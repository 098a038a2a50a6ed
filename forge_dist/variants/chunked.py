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


class LogDecay:
    """Cumulative log decays along one axis that stay exact through hard resets (``g = -inf``).

    A plain cumulative sum turns every value after a ``-inf`` into ``-inf``, and the
    difference of two of them, the decay between two tokens after the reset, into NaN.  Here
    the finite gates are summed apart (``cum``, a reset counts as 0) next to the number of
    resets so far (``resets``): the decay from token ``j`` to token ``i >= j`` is
    ``exp(cum_i - cum_j)`` when no reset lies in ``(j, i]`` (``resets_i == resets_j``), else
    exactly 0.  ``cum`` has the magnitude of the ordinary sums, so the cancellation in the
    differences is as precise as without resets.

    Args:
        g: log decays, any shape; ``dim``: the token axis.
    """

    def __init__(self, g: Tensor, dim: int):
        reset = torch.isneginf(g)
        self.dim = dim if dim >= 0 else g.dim() + dim
        self.cum = torch.where(reset, torch.zeros_like(g), g).cumsum(dim)
        self.resets = reset.to(torch.int32).cumsum(dim)

    def _last(self, x: Tensor) -> Tensor:
        return x.narrow(self.dim, x.shape[self.dim] - 1, 1)

    def from_start(self) -> Tensor:
        """``exp(g_0 + ... + g_i)`` per token (0 after a reset)."""
        return torch.where(self.resets == 0, self.cum, -torch.inf).exp()

    def total(self) -> Tensor:
        """``exp`` of the whole sum, the token axis removed (0 if it holds a reset)."""
        return torch.where(self._last(self.resets) == 0, self._last(self.cum),
                           -torch.inf).exp().squeeze(self.dim)

    def to_end(self) -> Tensor:
        """``exp(g_{j+1} + ... + g_last)`` per token ``j`` (0 if a reset follows ``j``)."""
        same = self._last(self.resets) == self.resets
        return torch.where(same, self._last(self.cum) - self.cum, -torch.inf).exp()

    def matrix(self, *, strict: bool = False) -> Tensor:
        """``exp(g_{j+1} + ... + g_i)`` for ``i >= j`` (``i > j`` when strict), else 0, over
        the last axis (the token axis must be last): ``[..., C] -> [..., C, C]``.  The
        difference is masked *before* the exponential so that ``i < j`` (a positive
        exponent) can never overflow."""
        if self.dim != self.cum.dim() - 1:
            raise ValueError("LogDecay.matrix: the token axis must be the last one")
        C = self.cum.shape[-1]
        diff = self.cum[..., :, None] - self.cum[..., None, :]
        keep = causal_mask(C, self.cum.device, strict=strict) & (
            self.resets[..., :, None] == self.resets[..., None, :])
        return torch.where(keep, diff, -torch.inf).exp()


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

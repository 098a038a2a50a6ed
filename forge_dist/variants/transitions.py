"""The affine-map algebra every variant and every strategy shares.

Every supported recurrence is affine in its state, ``S_t = A_t S_{t-1} + B_t``; a segment of
tokens (a chunk, a sequence piece, a rank's shard) therefore has a summary ``(M, dS)`` with
``S_end = M @ S_start + dS``.  What ``M`` is decides the cost of every combine:

=========  ===========================  ================================================
kind       M per segment                used by
=========  ===========================  ================================================
identity   ``None`` (the identity)      linear_attn
scalar     ``[B, H]``                   simple_gla, RetNet, Lightning, Mamba2
diagonal   ``[B, H, K]``                gla, HGRN2, hgrn (state ``[B, 1, D, 1]``)
dense      ``[B, H, K, K]``             gated_delta_rule, DeltaNet
=========  ===========================  ================================================

States are ``[B, H, K, V]``.  ``M`` acts on the K axis; columns of S (the V axis) are always
independent, and for the non-dense kinds every element is independent.  Nothing here
communicates: the strategies in :mod:`forge_dist.sp` and the kernels call these functions.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch
from torch import Tensor


class Kind(str, enum.Enum):
    """Transition kind of an affine state update (see module docstring)."""

    IDENTITY = "identity"
    SCALAR = "scalar"
    DIAGONAL = "diagonal"
    DENSE = "dense"


def apply(kind: Kind, M: Optional[Tensor], S: Tensor) -> Tensor:
    """``M @ S`` for a state ``S [B, H, K, V]``."""
    if kind is Kind.IDENTITY or M is None:
        return S
    if kind is Kind.SCALAR:
        return M[..., None, None] * S
    if kind is Kind.DIAGONAL:
        return M[..., None] * S
    return M @ S


def apply_transposed(kind: Kind, M: Optional[Tensor], S: Tensor) -> Tensor:
    """``M^T @ S``: the backward (reverse) chain uses the transposed transition."""
    if kind is Kind.DENSE and M is not None:
        return M.transpose(-1, -2) @ S
    return apply(kind, M, S)


def compose(kind: Kind, M2: Optional[Tensor], M1: Optional[Tensor]) -> Optional[Tensor]:
    """The transition of "first M1, then M2": ``M2 @ M1``."""
    if kind is Kind.IDENTITY or M1 is None:
        return M2
    if M2 is None:
        return M1
    if kind is Kind.DENSE:
        return M2 @ M1
    return M2 * M1


def combine(kind: Kind, M: Optional[Tensor], S: Tensor, dS: Tensor) -> Tensor:
    """``M @ S + dS``: the state after a segment whose summary is ``(M, dS)``."""
    return apply(kind, M, S) + dS


def transition_grad(kind: Kind, lam: Tensor, S: Tensor) -> Optional[Tensor]:
    """Gradient of ``<lam, M @ S>`` with respect to ``M`` (shape of ``M``)."""
    if kind is Kind.IDENTITY:
        return None
    if kind is Kind.SCALAR:
        return (lam * S).sum(dim=(-2, -1))
    if kind is Kind.DIAGONAL:
        return (lam * S).sum(dim=-1)
    return lam @ S.transpose(-1, -2)


def identity(kind: Kind, B: int, H: int, K: int, *, dtype, device) -> Optional[Tensor]:
    """The identity transition of the given kind (``None`` for the identity kind)."""
    if kind is Kind.IDENTITY:
        return None
    if kind is Kind.SCALAR:
        return torch.ones(B, H, dtype=dtype, device=device)
    if kind is Kind.DIAGONAL:
        return torch.ones(B, H, K, dtype=dtype, device=device)
    return torch.eye(K, dtype=dtype, device=device).expand(B, H, K, K).clone()


def zero(kind: Kind, B: int, H: int, K: int, *, dtype, device) -> Tensor:
    """The transition that forgets the incoming state (a sequence boundary).

    The identity kind has no zero, so a boundary promotes it to the scalar kind: callers use
    :func:`with_boundaries` to pick the kind first.
    """
    if kind in (Kind.IDENTITY, Kind.SCALAR):
        return torch.zeros(B, H, dtype=dtype, device=device)
    if kind is Kind.DIAGONAL:
        return torch.zeros(B, H, K, dtype=dtype, device=device)
    return torch.zeros(B, H, K, K, dtype=dtype, device=device)


def with_boundaries(kind: Kind) -> Kind:
    """The kind able to express a reset (M = 0): identity becomes scalar, others stay."""
    return Kind.SCALAR if kind is Kind.IDENTITY else kind


def promote(kind_from: Kind, kind_to: Kind, M: Optional[Tensor], B: int, H: int, K: int,
            *, dtype, device) -> Optional[Tensor]:
    """Express ``M`` of ``kind_from`` as a transition of the (wider) ``kind_to``."""
    if kind_from == kind_to:
        return M
    if kind_from is Kind.IDENTITY:
        return identity(kind_to, B, H, K, dtype=dtype, device=device)
    if kind_from is Kind.SCALAR and kind_to is Kind.DIAGONAL:
        return M[..., None].expand(B, H, K).clone()
    raise ValueError(f"cannot promote a {kind_from.value} transition to {kind_to.value}")


def tile_slices(kind: Kind, K: int, V: int, n_tiles: int):
    """Cut a ``[K, V]`` state into at most ``n_tiles`` independent tiles.

    Returns a list of ``(k_slice, v_slice)``.  Columns (V) are independent for every kind, so
    tiles run along V; a diagonal state with one column (HGRN, ``[B, 1, D, 1]``) is cut along K
    instead, which is valid because a diagonal M never mixes rows.
    """
    n_tiles = max(1, int(n_tiles))
    if kind is not Kind.DENSE and V < n_tiles and K >= n_tiles:
        bounds = _even_bounds(K, n_tiles)
        return [(slice(a, b), slice(0, V)) for a, b in bounds]
    bounds = _even_bounds(V, min(n_tiles, V))
    return [(slice(0, K), slice(a, b)) for a, b in bounds]


def slice_transition(kind: Kind, M: Optional[Tensor], k_slice: slice) -> Optional[Tensor]:
    """The part of ``M`` that acts on rows ``k_slice`` of a tile (see :func:`tile_slices`)."""
    if M is None or kind in (Kind.IDENTITY, Kind.SCALAR) or k_slice == slice(None):
        return M
    if kind is Kind.DIAGONAL:
        return M[..., k_slice]
    if k_slice.start == 0 and k_slice.stop == M.shape[-1]:
        return M
    raise ValueError("dense transitions are tiled along V only")


def _even_bounds(n: int, parts: int):
    step, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + step + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out

"""Shape-generic building blocks for the three callables (plain torch ops, traced through).

All take chunk tensors with the chunk (token) axis second to last (``[..., C, D]``) or last
(``[..., C]`` for per-token scalars), and work for any chunk length.
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal(x: Tensor, *, strict: bool = False) -> Tensor:
    """Boolean ``[C, C]`` mask, True where ``i >= j`` (``i > j`` if strict); ``x [..., C]``."""
    C = x.shape[-1]
    return x.new_ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)


def segsum_exp(G: Tensor, *, strict: bool = False) -> Tensor:
    """``exp(G_i - G_j)`` for ``i >= j``, else 0: ``G [..., C]`` -> ``[..., C, C]``.

    Masked *before* the exponential, so positive differences (``i < j``) never overflow.
    """
    diff = G[..., :, None] - G[..., None, :]
    return torch.where(causal(G, strict=strict), diff, float("-inf")).exp()


def segsum_exp_vec(G: Tensor) -> Tensor:
    """Per-feature ``exp(G_i - G_j)`` (``i >= j``): ``G [..., C, K]`` -> ``[..., C, C, K]``."""
    diff = G[..., :, None, :] - G[..., None, :, :]
    mask = causal(G[..., 0])[..., None]
    return torch.where(mask, diff, float("-inf")).exp()


def eye_like(x: Tensor) -> Tensor:
    """Identity ``[C, C]`` matching the chunk length of ``x [..., C, D]``."""
    C = x.shape[-2]
    return x.new_ones(C).diag()

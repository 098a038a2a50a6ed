"""Named model families expressed through the five core ops (docs/design.md section 1).

Each wrapper only maps a model's parameterisation onto an op; sequence parallelism,
``initial_state``, ``cu_seqlens`` and ``strategy`` pass straight through as keywords.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import checks
from .attention import gated_delta_rule, gla, simple_gla


def retnet_decays(num_heads: int, *, device=None) -> Tensor:
    """RetNet's per-head log decays ``log(1 - 2^(-5 - h))``, ``h = 0..H-1`` (fp32 ``[H]``)."""
    h = torch.arange(num_heads, dtype=torch.float64, device=device)
    return torch.log1p(-torch.exp2(-5.0 - h)).to(torch.float32)


@checks.collective
def retnet(q: Tensor, k: Tensor, v: Tensor, **kwargs):
    """RetNet retention: scalar decay with RetNet's fixed per-head rates (``simple_gla``)."""
    checks.tensor("q", q, [None, None, None, None])
    gamma = retnet_decays(q.shape[2], device=q.device)
    return simple_gla(q, k, v, g_gamma=gamma, **kwargs)


@checks.collective
def lightning_attn(q: Tensor, k: Tensor, v: Tensor, *, layer_idx: int, num_layers: int,
                   **kwargs):
    """Lightning Attention: constant per-head decays that weaken with depth.

    Head h decays at rate ``s_h = 2^(-8 (h + 1) / H)`` scaled by
    ``1 - layer_idx / (num_layers - 1) + 1e-5`` (TransNormerLLM's slopes); log decay ``-s``.
    """
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
    if not (isinstance(layer_idx, int) and 0 <= layer_idx < num_layers):
        raise ValueError(f"layer_idx: expected an int in [0, {num_layers}), got {layer_idx!r}")
    checks.tensor("q", q, [None, None, None, None])
    H = q.shape[2]
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
    depth = 1.0 - layer_idx / max(num_layers - 1, 1) + 1e-5
    g_gamma = (-slopes * depth).to(torch.float32).to(q.device)
    return simple_gla(q, k, v, g_gamma=g_gamma, **kwargs)


@checks.collective
def mamba2_ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
               D: Optional[Tensor] = None, **kwargs):
    """Mamba2's SSD as scalar-decay attention: ``q = C, k = B, v = x * dt, g = A * dt``.

    Args:
        x: ``[b, T, H, P]`` inputs; dt: ``[b, T, H]`` positive step sizes (after softplus);
        A: ``[H]`` negative rates; B, C: ``[b, T, G, N]`` with ``G`` dividing ``H`` (groups
        are shared by ``H / G`` heads); D: optional ``[H]`` skip.
    Returns:
        ``y [b, T, H, P]`` and the final state ``[b, H, N, P]`` (or ``None``).
    """
    checks.tensor("x", x, [None, None, None, None])
    b, T, H, P = x.shape
    checks.tensor("dt", dt, [b, T, H])
    checks.tensor("A", A, [H])
    checks.tensor("B", B, [b, T, None, None])
    G, N = B.shape[2], B.shape[3]
    checks.tensor("C", C, [b, T, G, N])
    if H % G:
        raise ValueError(f"B: expected a group count that divides H={H}, got {G}")
    if D is not None:
        checks.tensor("D", D, [H])
    rep = H // G
    k = B.repeat_interleave(rep, dim=2)
    q = C.repeat_interleave(rep, dim=2)
    v = x * dt[..., None].to(x.dtype)
    g = A.to(dt.dtype) * dt
    kwargs.setdefault("scale", 1.0)
    y, state = simple_gla(q, k, v, g=g, **kwargs)
    if D is not None:
        y = y + (D[:, None] * x).to(y.dtype)
    return y, state


@checks.collective
def hgrn2(q: Tensor, g: Tensor, v: Tensor, **kwargs):
    """HGRN2: GLA whose key is the complement of the forget gate, ``k = 1 - exp(g)``.

    Args:
        q, g: ``[B, T, H, K]`` (g: log forget gates); v: ``[B, T, H, V]``.
    """
    checks.tensor("g", g, [None, None, None, None])
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    k = (-torch.expm1(g.to(wide))).to(q.dtype)
    return gla(q, k, v, g, **kwargs)


@checks.collective
def deltanet(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, **kwargs):
    """DeltaNet: the delta rule without decay (``gated_delta_rule`` with ``g=None``)."""
    return gated_delta_rule(q, k, v, None, beta, **kwargs)

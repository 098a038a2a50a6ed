"""RMS norms with FLA's parameter names (``weight``, optional ``bias``), computed in fp32.

These are per-token (no communication): identical at any sequence-parallel degree.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _wide(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` in fp32 (fp64 for fp64 inputs)."""
    xf = x.to(_wide(x))
    return xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``fla.modules.RMSNorm``: ``y = x / rms(x) * weight (+ bias)`` over the last dim."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps, self.elementwise_affine = hidden_size, eps, elementwise_affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., D]`` -> same shape and dtype."""
        with torch.autocast(x.device.type, enabled=False):
            y = rms_normalize(x, self.eps)
            if self.weight is not None:
                y = y * self.weight.to(y.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)


_GATES = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


class FusedRMSNormGated(nn.Module):
    """``fla.modules.FusedRMSNormGated``: ``y = rmsnorm(x) * weight * act(g)``, act = swish.

    Used per head (``hidden_size = head_v_dim``) by GLA, RetNet, GDN, and over the whole width
    by HGRN.
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None):
        super().__init__()
        if activation not in _GATES:
            raise ValueError(f"activation: expected one of {list(_GATES)}, got {activation!r}")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.elementwise_affine = elementwise_affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, g: Tensor) -> Tensor:
        """``x, g [..., D]`` -> ``[..., D]`` in the dtype of ``x``."""
        with torch.autocast(x.device.type, enabled=False):
            y = rms_normalize(x, self.eps)
            if self.weight is not None:
                y = y * self.weight.to(y.dtype)
            y = y * _GATES[self.activation](g.to(y.dtype))
        return y.to(x.dtype)


class RMSNormGated(nn.Module):
    """Mamba2's gated RMSNorm (``fla.modules.layernorm_gated.RMSNormGated``).

    ``norm_before_gate=False``: ``y = groupnorm(x * silu(z)) * weight``; ``True``:
    ``y = groupnorm(x) * weight * silu(z)``; the RMS is taken over groups of ``group_size``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.group_size = hidden_size if group_size is None else group_size
        if hidden_size % self.group_size:
            raise ValueError(f"group_size: expected a divisor of {hidden_size}, got {group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: Tensor, z: Optional[Tensor] = None) -> Tensor:
        """``x, z [..., D]`` -> ``[..., D]`` in the dtype of ``x``."""
        with torch.autocast(x.device.type, enabled=False):
            xf = x.to(_wide(x))
            if z is not None and not self.norm_before_gate:
                xf = xf * F.silu(z.to(xf.dtype))
            shape = xf.shape
            grouped = xf.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
            y = rms_normalize(grouped, self.eps).reshape(shape) * self.weight.to(xf.dtype)
            if z is not None and self.norm_before_gate:
                y = y * F.silu(z.to(y.dtype))
        return y.to(x.dtype)

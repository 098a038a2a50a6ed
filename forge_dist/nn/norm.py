"""RMS norms with FLA's parameter names (``weight``, optional ``bias``), computed in fp32.

These are per-token (no communication): identical at any sequence-parallel degree.

:class:`RMSNorm` and :class:`FusedRMSNormGated` run through :class:`_RMSNormFn`, which keeps
only its inputs and the per-row ``1/rms`` for the backward and does the fp32 arithmetic in
slices of rows: the plain autograd graph of the same formula holds five fp32 copies of the
activation (20 GiB for a 1M-token GDN layer of width 1024), this holds none.

On CUDA (and under ``TRITON_INTERPRET=1`` with ``FORGE_DIST_KERNELS=triton``) every norm here
runs as the fused kernels of :mod:`forge_dist.kernels.gated_norm` instead: one pass that
reads the input and the gate and writes the output, with the same saved tensors (inputs and
``1/rms``).  :class:`_RMSNormFn` is the PyTorch path elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.gated_norm import gated_rms_norm
from .fused import use_fused


def _wide(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` in fp32 (fp64 for fp64 inputs)."""
    xf = x.to(_wide(x))
    return xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)


_GATES = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}
#: fp32 elements per slice of rows in :class:`_RMSNormFn` (128 MiB temporaries).
_SLICE_ELEMENTS = 1 << 25


def _gate_and_slope(g: Tensor, activation: str):
    """``act(g)`` and ``act'(g)`` for swish/silu and sigmoid."""
    s = torch.sigmoid(g)
    if activation == "sigmoid":
        return s, s * (1 - s)
    return g * s, s * (1 + g * (1 - s))


class _RMSNormFn(torch.autograd.Function):
    """``y = x / rms(x) * weight (+ bias) (* act(g))`` over the last dim, rows ``[N, D]``.

    Saves ``x``, ``g``, ``weight`` and ``rstd [N]`` (fp32) and recomputes the rest in the
    backward; both passes work on slices of ``_SLICE_ELEMENTS`` so fp32 temporaries stay small.
    """

    @staticmethod
    def forward(ctx, x, g, weight, bias, eps, activation):
        wide = _wide(x)
        N, D = x.shape
        step = max(1, _SLICE_ELEMENTS // max(D, 1))
        out = torch.empty_like(x)
        rstd = torch.empty(N, dtype=wide, device=x.device)
        w = None if weight is None else weight.to(wide)
        b = None if bias is None else bias.to(wide)
        for s in range(0, N, step):
            xf = x[s:s + step].to(wide)
            r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
            y = xf * r
            if w is not None:
                y = y * w
            if b is not None:
                y = y + b
            if g is not None:
                y = y * _GATES[activation](g[s:s + step].to(wide))
            out[s:s + step] = y
            rstd[s:s + step] = r[:, 0]
        ctx.save_for_backward(x, g, weight, bias, rstd)
        ctx.meta = (activation, step)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, g, weight, bias, rstd = ctx.saved_tensors
        activation, step = ctx.meta
        wide = rstd.dtype
        need_x, need_g, need_w, need_b = ctx.needs_input_grad[:4]
        dx = torch.empty_like(x) if need_x else None
        dg = torch.empty_like(g) if need_g else None
        dw = torch.zeros(x.shape[1], dtype=wide, device=x.device) if need_w else None
        db = torch.zeros(x.shape[1], dtype=wide, device=x.device) if need_b else None
        w = None if weight is None else weight.to(wide)
        b = None if bias is None else bias.to(wide)
        for s in range(0, x.shape[0], step):
            r = rstd[s:s + step, None]
            xhat = x[s:s + step].to(wide) * r
            d = grad_out[s:s + step].to(wide)
            if g is not None:
                gate, slope = _gate_and_slope(g[s:s + step].to(wide), activation)
                if need_g:
                    pre = xhat if w is None else xhat * w
                    if b is not None:
                        pre = pre + b
                    dg[s:s + step] = d * pre * slope
                d = d * gate
            if need_b:
                db += d.sum(dim=0)
            if w is not None:
                if need_w:
                    dw += (d * xhat).sum(dim=0)
                d = d * w
            if need_x:
                dx[s:s + step] = r * (d - xhat * (d * xhat).mean(dim=-1, keepdim=True))
        return (dx, dg, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None)


def _rms_norm(x: Tensor, g: Optional[Tensor], weight: Optional[Tensor],
              bias: Optional[Tensor], eps: float, activation: str = "swish") -> Tensor:
    """``x [..., D]`` (and ``g`` of the same shape) through the fused kernels or
    :class:`_RMSNormFn`."""
    if use_fused(x.device):  # Triton kernels: autocast changes nothing there
        return gated_rms_norm(x, g, weight, bias, eps, activation)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    gate = None if g is None else g.reshape(-1, shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        return _RMSNormFn.apply(rows, gate, weight, bias, eps, activation).reshape(shape)


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
        return _rms_norm(x, None, self.weight, self.bias, self.eps)



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
        """``x, g [..., D]`` -> ``[..., D]`` in the dtype of ``x``; ``g`` broadcasts to ``x``."""
        if g.shape != x.shape:
            g = g.expand(x.shape)
        return _rms_norm(x, g, self.weight, None, self.eps, self.activation)


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
        if use_fused(x.device):
            if z is not None and z.shape != x.shape:
                z = z.expand(x.shape)
            return gated_rms_norm(x, z, self.weight, self.bias, self.eps, "swish",
                                  gate_before=not self.norm_before_gate,
                                  groups=x.shape[-1] // self.group_size)
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

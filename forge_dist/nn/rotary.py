"""Rotary position embedding (FLA's ``RotaryEmbedding``, GPT-NeoX layout) at global positions.

Under sequence parallelism a token's angle must come from its position in the *global*
sequence (with ``cu_seqlens``: inside its packed sequence), not from its index in the local
shard; :func:`forge_dist.nn.shard.positions` supplies that.  On CUDA (and under the
interpreter with ``FORGE_DIST_KERNELS=triton``) the rotation is one fused kernel
(:mod:`forge_dist.kernels.rotary`); elsewhere the PyTorch formula below.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..kernels.rotary import rotary
from .fused import use_fused


class RotaryEmbedding(nn.Module):
    """Rotate the first ``dim`` channels of each head (halves layout, ``interleaved=False``).

    ``inv_freq`` is a non-persistent buffer as in FLA: it is not part of the state dict.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        if interleaved:
            raise NotImplementedError("interleaved (GPT-J) rotary is not supported")
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def _apply(self, fn, *args, **kwargs):
        # keep inv_freq fp32 whatever .to(dtype) the module gets (FLA keeps it fp32 too)
        out = super()._apply(fn, *args, **kwargs)
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        return out

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        """``x [B, T, H, D]``, ``pos [T]`` -> rotated ``x``."""
        if use_fused(x.device):
            return rotary(x, None, pos, self.inv_freq)[0]
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        ang = pos.to(wide)[:, None] * self.inv_freq.to(wide)[None, :]  # [T, dim/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
        rot, rest = x[..., :self.dim].to(wide), x[..., self.dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * cos + torch.cat([-x2, x1], -1) * sin
        return torch.cat([out.to(x.dtype), rest], -1)

    def forward(self, q: Tensor, k: Tensor, pos: Optional[Tensor] = None, pos0: int = 0):
        """``q, k [B, T, H, D]`` (H may differ) at positions ``pos [T]``, or ``pos0 + t``
        where ``pos`` is ``None`` -> ``(q, k)`` rotated.  On the fused path both in one
        kernel, the angles computed once per token."""
        if use_fused(q.device):
            return rotary(q, k, pos, self.inv_freq, pos0)
        if pos is None:
            pos = torch.arange(pos0, pos0 + q.shape[1], device=q.device)
        return self.rotate(q, pos), self.rotate(k, pos)

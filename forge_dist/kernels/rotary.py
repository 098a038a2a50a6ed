"""Fused rotary embedding (GPT-NeoX halves layout) at given token positions.

``x [B, T, H, D]`` (any strides over ``B, T, H``, unit channel stride) -> contiguous
``[B, T, H, D]``: the first ``dim`` channels of each head rotate by ``pos[t] * inv_freq``
(``x1, x2`` the two halves: ``(x1 cos - x2 sin, x2 cos + x1 sin)``), the rest pass through.
The angles are computed in the kernel (fp32; fp64 for fp64 inputs), so the forward is one read
and one write and the backward (the rotation by the opposite angle) saves only ``pos``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .compat import HAVE_TRITON, tl, triton

BLOCK_T = 32

if HAVE_TRITON:

    @triton.jit
    def _rotary_kernel(x, pos, inv_freq, y, T, H, D, sxb, sxt, sxh, SIGN: tl.constexpr,
                       HALF: tl.constexpr, BH: tl.constexpr, REST: tl.constexpr,
                       BREST: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr):
        """Grid ``(cdiv(T, BT), H, B)``; ``SIGN=-1`` rotates back (the backward)."""
        pt, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = pt * BT + tl.arange(0, BT)
        mt = t < T
        j = tl.arange(0, BH)
        mj = j < HALF
        m = mt[:, None] & mj[None, :]
        src = x + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t.to(tl.int64)[:, None] * sxt
        dst = y + ((b.to(tl.int64) * T + t.to(tl.int64)) * H + h)[:, None] * D
        p = tl.load(pos + t, mask=mt, other=0).to(ACC)
        ang = p[:, None] * tl.load(inv_freq + j, mask=mj, other=0.0).to(ACC)[None, :]
        c, s = tl.cos(ang), tl.sin(ang) * SIGN
        x1 = tl.load(src + j[None, :], mask=m, other=0.0).to(ACC)
        x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0).to(ACC)
        tl.store(dst + j[None, :], (x1 * c - x2 * s).to(y.dtype.element_ty), mask=m)
        tl.store(dst + HALF + j[None, :], (x2 * c + x1 * s).to(y.dtype.element_ty), mask=m)
        if REST > 0:
            r = tl.arange(0, BREST)
            mr = mt[:, None] & (r < REST)[None, :]
            v = tl.load(src + 2 * HALF + r[None, :], mask=mr, other=0.0)
            tl.store(dst + 2 * HALF + r[None, :], v, mask=mr)


def _launch(x: Tensor, pos: Tensor, inv_freq: Tensor, sign: int) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, H, D = x.shape
    half = inv_freq.shape[0]
    y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    rest = D - 2 * half
    if x.numel():
        _rotary_kernel[(triton.cdiv(T, BLOCK_T), H, B)](
            x, pos, inv_freq, y, T, H, D, x.stride(0), x.stride(1), x.stride(2), SIGN=sign,
            HALF=half, BH=triton.next_power_of_2(half), REST=rest,
            BREST=triton.next_power_of_2(max(rest, 1)),
            ACC=tl.float64 if x.dtype == torch.float64 else tl.float32, BT=BLOCK_T)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, inv_freq):
        ctx.save_for_backward(pos, inv_freq)
        return _launch(x, pos, inv_freq, 1)

    @staticmethod
    def backward(ctx, dy):
        pos, inv_freq = ctx.saved_tensors
        return _launch(dy, pos, inv_freq, -1), None, None


def rotary(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, D]`` at positions ``pos [T]`` by ``inv_freq [dim / 2]`` (the
    first ``dim <= D`` channels of each head)."""
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(f"inv_freq: {inv_freq.shape[0]} frequencies rotate "
                         f"{2 * inv_freq.shape[0]} channels, more than x's {x.shape[-1]}")
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _Rotary.apply(x, pos.contiguous(), inv_freq.to(wide).contiguous())

"""Fused rotary embedding (GPT-NeoX halves layout) of q and k at given token positions.

``q [B, T, Hq, D]`` and ``k [B, T, Hk, D]`` (any strides over ``B, T, H``, unit channel
stride) -> contiguous copies: the first ``dim`` channels of each head rotate by
``pos[t] * inv_freq`` (``x1, x2`` the two halves: ``(x1 cos - x2 sin, x2 cos + x1 sin)``),
the rest pass through.  One program takes a tile of tokens and every head of q and of k,
computing the tile's angles once (fp32; fp64 for fp64 inputs): the forward is one read and one
write of q and k, and the backward (the rotation by the opposite angle) saves only the
positions.  Positions are a tensor ``pos [T]`` or, for one unpacked sequence, the range
``pos0 + t`` computed in the kernel.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, differentiated, next_pow2, tl, triton
from .jit_launch import KeptLaunches

BLOCK_T = 32

if HAVE_TRITON:

    @triton.jit
    def _rotate_heads(x, y, b, t, mt, c, s, T, H, D, sxb, sxt, sxh, HALF: tl.constexpr,
                      BH: tl.constexpr, REST: tl.constexpr, BREST: tl.constexpr):
        """Rotate every head of ``x`` at tokens ``t`` by the angles' ``c, s [BT, BH]``."""
        j = tl.arange(0, BH)
        m = mt[:, None] & (j < HALF)[None, :]
        r = tl.arange(0, BREST)
        mr = mt[:, None] & (r < REST)[None, :]
        rows = b.to(tl.int64) * sxb + t.to(tl.int64)[:, None] * sxt
        out_rows = (b.to(tl.int64) * T + t.to(tl.int64))[:, None] * H
        for h in range(H):
            src = x + rows + h * sxh
            dst = y + (out_rows + h) * D
            x1 = tl.load(src + j[None, :], mask=m, other=0.0).to(c.dtype)
            x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0).to(c.dtype)
            tl.store(dst + j[None, :], (x1 * c - x2 * s).to(y.dtype.element_ty), mask=m)
            tl.store(dst + HALF + j[None, :], (x2 * c + x1 * s).to(y.dtype.element_ty), mask=m)
            if REST > 0:
                v = tl.load(src + 2 * HALF + r[None, :], mask=mr, other=0.0)
                tl.store(dst + 2 * HALF + r[None, :], v, mask=mr)

    @triton.jit
    def _rotary_kernel(q, k, pos, inv_freq, yq, yk, T, HQ, HK, D, sqb, sqt, sqh, skb, skt, skh,
                       pos0, SIGN: tl.constexpr, HAS_K: tl.constexpr, HAS_POS: tl.constexpr,
                       HALF: tl.constexpr, BH: tl.constexpr, REST: tl.constexpr,
                       BREST: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr):
        """Grid ``(cdiv(T, BT), B)``; ``SIGN=-1`` rotates back (the backward)."""
        pt, b = tl.program_id(0), tl.program_id(1)
        t = pt * BT + tl.arange(0, BT)
        mt = t < T
        if HAS_POS:
            p = tl.load(pos + t, mask=mt, other=0).to(ACC)
        else:
            p = (pos0 + t).to(ACC)
        j = tl.arange(0, BH)
        ang = p[:, None] * tl.load(inv_freq + j, mask=j < HALF, other=0.0).to(ACC)[None, :]
        c, s = tl.cos(ang), tl.sin(ang) * SIGN
        _rotate_heads(q, yq, b, t, mt, c, s, T, HQ, D, sqb, sqt, sqh, HALF, BH, REST, BREST)
        if HAS_K:
            _rotate_heads(k, yk, b, t, mt, c, s, T, HK, D, skb, skt, skh, HALF, BH, REST,
                          BREST)

    _rotate = KeptLaunches(_rotary_kernel)


def _unit_channels(x: Optional[Tensor]) -> Optional[Tensor]:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _launch(q: Tensor, k: Optional[Tensor], pos: Optional[Tensor], pos0: int,
            inv_freq: Tensor, sign: int) -> Tuple[Tensor, Optional[Tensor]]:
    q, k = _unit_channels(q), _unit_channels(k)
    B, T, HQ, D = q.shape
    HK = 0 if k is None else k.shape[2]
    half = inv_freq.shape[0]
    yq = torch.empty(B, T, HQ, D, dtype=q.dtype, device=q.device)
    yk = None if k is None else torch.empty(B, T, HK, D, dtype=k.dtype, device=k.device)
    rest = D - 2 * half
    sk = (0, 0, 0) if k is None else k.stride()[:3]
    if B and T and D:
        _rotate((cdiv(T, BLOCK_T), B),
                q, k, pos, inv_freq, yq, yk, T, HQ, HK, D, *q.stride()[:3], *sk, pos0,
                SIGN=sign, HAS_K=k is not None, HAS_POS=pos is not None, HALF=half,
                BH=next_pow2(half), REST=rest,
                BREST=next_pow2(max(rest, 1)),
                ACC=tl.float64 if q.dtype == torch.float64 else tl.float32, BT=BLOCK_T)
    return yq, yk


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, pos, pos0, inv_freq):
        ctx.save_for_backward(pos, inv_freq)
        ctx.pos0 = pos0
        yq, yk = _launch(q, k, pos, pos0, inv_freq, 1)
        # an output whose input asks no gradient carries none
        if not q.requires_grad:
            ctx.mark_non_differentiable(yq)
        if k is not None and not k.requires_grad:
            ctx.mark_non_differentiable(yk)
        return yq, yk

    @staticmethod
    def backward(ctx, dq, dk):
        # autograd hands zeros for an unused output (materialised grads)
        pos, inv_freq = ctx.saved_tensors
        want_q, want_k = ctx.needs_input_grad[:2]
        if want_q:
            dq, dk = _launch(dq, dk if want_k else None, pos, ctx.pos0, inv_freq, -1)
        else:  # only k's: rotate it in q's place
            dq, dk = None, _launch(dk, None, pos, ctx.pos0, inv_freq, -1)[0]
        return dq, dk if want_k else None, None, None, None


def rotary(q: Tensor, k: Optional[Tensor], pos: Optional[Tensor], inv_freq: Tensor,
           pos0: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
    """Rotate ``q [B, T, Hq, D]`` and ``k [B, T, Hk, D]`` (or ``None``; the dtype of ``q``)
    at positions ``pos [T]`` (``None``: ``pos0 + t``; ``pos0`` is not read where ``pos`` is
    given) by ``inv_freq [dim / 2]`` (the first ``dim <= D`` channels of each head) ->
    ``(q, k)`` rotated, contiguous."""
    if 2 * inv_freq.shape[0] > q.shape[-1]:
        raise ValueError(f"inv_freq: {inv_freq.shape[0]} frequencies rotate "
                         f"{2 * inv_freq.shape[0]} channels, more than q's {q.shape[-1]}")
    if k is not None and (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1],
                                                                  q.shape[3]):
        raise ValueError(f"k: expected [B, T, Hk, D] = [{q.shape[0]}, {q.shape[1]}, Hk, "
                         f"{q.shape[3]}] (q's B, T and D), got {list(k.shape)}")
    if k is not None and k.dtype != q.dtype:
        raise ValueError(f"k: expected q's dtype {q.dtype}, got {k.dtype}")
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    pos = None if pos is None else pos.contiguous()
    inv_freq = inv_freq.to(wide).contiguous()
    if differentiated(q, k):
        return _Rotary.apply(q, k, pos, int(pos0), inv_freq)
    return _launch(q, k, pos, int(pos0), inv_freq, 1)

"""Fused short causal depthwise convolution in the ``[B, T, D]`` layout (no transposes).

``y[b, t, d] = act(sum_i w[d, i] * x[b, t - (W-1) + i, d] + bias[d])`` for ``W <= 4`` taps,
``act`` SiLU or the identity.  Tokens before the shard's first token come from ``halo``
(``[B, W-1, D]``: the previous rank's last ``W-1`` inputs under sequence parallelism) or are
zero; with ``pos`` (``[T]`` int, each token's position in its packed sequence) tap ``s``
(reading ``t - s``) counts only where ``pos[t] >= s``, so packed sequences never mix.

Forward: one read of ``x`` (the shifted re-reads hit L1/L2) and one write of ``y``.
Backward: the pre-activation is recomputed at the ``W`` shifts a token's gradient needs, so
nothing but ``x`` and the halo is saved; ``dw``/``db`` are per-program partial sums reduced
on the host side by one ``sum``.  ``x`` may be a strided view with unit channel stride (e.g.
a split of a fused projection); ``y`` and the gradients are contiguous.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..variants import delta_rule
from .compat import HAVE_TRITON, cdiv, differentiated, tl, triton
from .jit_launch import KeptLaunches

MAX_WIDTH = 4
#: the L2 normalisation's epsilon, inside the root (``variants.delta_rule.l2_normalize``)
L2_EPS = delta_rule.L2_EPS
#: token and channel tile of one program
BLOCK_T, BLOCK_D = 64, 128

if HAVE_TRITON:
    _EPS = tl.constexpr(L2_EPS)

    @triton.jit
    def _tap(x, halo, b, rows, cols, mask_d, T, D, sxb, sxt, HALO_ROWS: tl.constexpr,
             HAS_HALO: tl.constexpr):
        """``x`` at local rows ``rows`` (``[BT]``, may be negative: the halo), fp32/fp64."""
        inside = (rows >= 0) & (rows < T)
        off = b.to(tl.int64) * sxb + rows.to(tl.int64)[:, None] * sxt + cols[None, :]
        v = tl.load(x + off, mask=inside[:, None] & mask_d[None, :], other=0.0)
        if HAS_HALO:
            hr = rows + HALO_ROWS
            in_halo = (rows < 0) & (hr >= 0)
            hoff = (b.to(tl.int64) * HALO_ROWS + hr.to(tl.int64))[:, None] * D + cols[None, :]
            v += tl.load(halo + hoff, mask=in_halo[:, None] & mask_d[None, :], other=0.0)
        return v

    @triton.jit
    def _pre(x, halo, w, bias, pos, b, rows, cols, mask_d, T, D, sxb, sxt,
             W: tl.constexpr, HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_POS: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        """Pre-activation at rows ``rows`` (``>= 0``), ``[BT, BD]`` in ``ACC``."""
        acc = tl.zeros([BT, BD], dtype=ACC)
        if HAS_POS:
            p = tl.load(pos + rows, mask=(rows >= 0) & (rows < T), other=0)
        for i in tl.static_range(W):
            s = W - 1 - i  # this tap reads token t - s
            wi = tl.load(w + cols * W + i, mask=mask_d, other=0.0).to(ACC)
            v = _tap(x, halo, b, rows - s, cols, mask_d, T, D, sxb, sxt, W - 1,
                     HAS_HALO).to(ACC)
            if HAS_POS:
                v = tl.where((p >= s)[:, None], v, 0.0)
            acc += v * wi[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=mask_d, other=0.0).to(ACC)[None, :]
        return acc

    @triton.jit
    def _short_conv_fwd_kernel(x, halo, w, bias, pos, y, T, D, sxb, sxt,
                               W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
                               HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                               L2NORM: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                               BD: tl.constexpr):
        """Grid ``(cdiv(T, BT), cdiv(D, BD), B)``; ``y`` contiguous ``[B, T, D]``.  With
        ``L2NORM`` a column tile is one head and each token's head is L2-normalised."""
        pt, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pt * BT + tl.arange(0, BT)
        cols = pd * BD + tl.arange(0, BD)
        mask_d = cols < D
        acc = _pre(x, halo, w, bias, pos, b, rows, cols, mask_d, T, D, sxb, sxt, W, HAS_HALO,
                   HAS_BIAS, HAS_POS, ACC, BT, BD)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        if L2NORM:  # acc / sqrt(|acc|^2 + eps), FLA's form
            eps = tl.full([BT], _EPS, ACC)  # a float literal would be fp32 in fp64 math
            acc = acc / tl.sqrt(tl.sum(acc * acc, axis=1) + eps)[:, None]
        off = (b.to(tl.int64) * T + rows.to(tl.int64))[:, None] * D + cols[None, :]
        tl.store(y + off, acc.to(y.dtype.element_ty),
                 mask=(rows < T)[:, None] & mask_d[None, :])

    @triton.jit
    def _short_conv_bwd_kernel(x, halo, w, bias, pos, dy, dx, dhalo, dw_part, db_part,
                               T, D, sxb, sxt, W: tl.constexpr, SILU: tl.constexpr,
                               HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr,
                               HAS_POS: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr,
                               BT: tl.constexpr, BD: tl.constexpr):
        """Grid ``(cdiv(T + W - 1, BT), cdiv(D, BD), B)`` over rows ``-(W-1) .. T-1``: rows
        below zero are the halo's (its gradient, for the previous rank).  ``dw_part``
        ``[B * n_t, D, W]`` and ``db_part`` ``[B * n_t, D]`` partial sums (fp32; fp64 for fp64)."""
        pt, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pt * BT + tl.arange(0, BT) - (W - 1)
        cols = pd * BD + tl.arange(0, BD)
        mask_d = cols < D
        dxa = tl.zeros([BT, BD], dtype=ACC)
        # the gradient at row t gathers dpre(t + s) * w[W-1-s] over the taps s
        for j in tl.static_range(W):
            s = W - 1 - j
            r = rows + s
            live = (r >= 0) & (r < T)
            pre = _pre(x, halo, w, bias, pos, b, r, cols, mask_d, T, D, sxb, sxt, W,
                       HAS_HALO, HAS_BIAS, HAS_POS, ACC, BT, BD)
            g = tl.load(dy + (b.to(tl.int64) * T + r.to(tl.int64))[:, None] * D + cols[None, :],
                        mask=live[:, None] & mask_d[None, :], other=0.0).to(ACC)
            if SILU:
                sg = 1.0 / (1.0 + tl.exp(-pre))
                act = pre * sg
            else:
                act = pre
            if L2NORM:  # n = act * r, r = (|act|^2 + eps)^-1/2: dact = r (dn - n (dn . n))
                eps = tl.full([BT], _EPS, ACC)  # a float literal would be fp32 in fp64 math
                den = tl.sqrt(tl.sum(act * act, axis=1) + eps)
                n = act / den[:, None]
                g = (g - n * tl.sum(g * n, axis=1)[:, None]) / den[:, None]
            if SILU:
                g = g * sg * (1.0 + pre * (1.0 - sg))
            if HAS_POS:
                p = tl.load(pos + r, mask=live, other=0)
                use = p >= s
            else:
                use = live
            wj = tl.load(w + cols * W + j, mask=mask_d, other=0.0).to(ACC)
            dxa += tl.where(use[:, None], g, 0.0) * wj[None, :]
            if s == 0:  # dpre at this program's own rows: the weight and bias gradients
                own = rows >= 0
                g = tl.where(own[:, None], g, 0.0)
                part = (b * tl.num_programs(0) + pt).to(tl.int64)
                if HAS_BIAS:
                    tl.store(db_part + part * D + cols,
                             tl.sum(g, axis=0).to(db_part.dtype.element_ty),
                             mask=mask_d)
                for i in tl.static_range(W):
                    si = W - 1 - i
                    v = _tap(x, halo, b, rows - si, cols, mask_d, T, D, sxb, sxt, W - 1,
                             HAS_HALO).to(ACC)
                    if HAS_POS:
                        v = tl.where((p >= si)[:, None], v, 0.0)
                    tl.store(dw_part + (part * D + cols) * W + i,
                             tl.sum(g * v, axis=0).to(dw_part.dtype.element_ty), mask=mask_d)
        body = rows >= 0
        tl.store(dx + (b.to(tl.int64) * T + rows.to(tl.int64))[:, None] * D + cols[None, :],
                 dxa.to(dx.dtype.element_ty), mask=(body & (rows < T))[:, None] & mask_d[None, :])
        if HAS_HALO:
            hr = rows + (W - 1)
            tl.store(dhalo + (b.to(tl.int64) * (W - 1) + hr.to(tl.int64))[:, None] * D
                     + cols[None, :], dxa.to(dhalo.dtype.element_ty),
                     mask=((rows < 0) & (hr >= 0))[:, None] & mask_d[None, :])

    @triton.jit
    def _short_conv_step_kernel(x, cache, w, bias, y, D, W: tl.constexpr, SILU: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BD: tl.constexpr):
        """One decoding step per row: shift ``cache [B, D, W]`` left, append ``x [B, D]``,
        ``y [B, D] = act(sum_i cache[:, :, i] * w[:, i] + bias)``.  Grid ``(cdiv(D, BD), B)``."""
        pd, b = tl.program_id(0), tl.program_id(1)
        cols = pd * BD + tl.arange(0, BD)
        m = cols < D
        base = cache + (b.to(tl.int64) * D + cols) * W
        acc = tl.zeros([BD], dtype=tl.float32)
        for i in tl.static_range(W):
            if i < W - 1:
                v = tl.load(base + i + 1, mask=m, other=0.0)
            else:
                v = tl.load(x + b.to(tl.int64) * D + cols, mask=m, other=0.0)
            tl.store(base + i, v.to(cache.dtype.element_ty), mask=m)
            acc += v.to(tl.float32) * tl.load(w + cols * W + i, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=m, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + b.to(tl.int64) * D + cols, acc.to(y.dtype.element_ty), mask=m)


    _conv_fwd = KeptLaunches(_short_conv_fwd_kernel)
    _conv_bwd = KeptLaunches(_short_conv_bwd_kernel)
    _conv_step = KeptLaunches(_short_conv_step_kernel)


def _blocks(head_dim: Optional[int]) -> Tuple[int, int]:
    """(token tile, channel tile): a channel tile is one head when heads are normalised."""
    if head_dim is None:
        return BLOCK_T, BLOCK_D
    return max(16, BLOCK_T * BLOCK_D // head_dim), head_dim


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows_view(x: Tensor) -> Tensor:
    """``x`` with unit channel stride (a copy only if it has none)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _conv_forward(x, weight, bias, halo, pos, silu, head_dim):
    """The forward launch; returns what the backward keeps (``x`` as read, the taps
    ``[D, W]``, the halo and positions as the kernel took them) and ``y``."""
    x = _rows_view(x)
    B, T, D = x.shape
    W = weight.shape[-1]
    w = weight.reshape(D, W).contiguous()
    halo = None if halo is None else halo.to(x.dtype).contiguous()
    pos = None if pos is None else pos.to(torch.int32).contiguous()
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    BT, BD = _blocks(head_dim)
    if T:
        _conv_fwd((cdiv(T, BT), cdiv(D, BD), B),
                  x, halo, w, bias, pos, y, T, D, x.stride(0), x.stride(1), W=W, SILU=silu,
                  HAS_HALO=halo is not None, HAS_BIAS=bias is not None, HAS_POS=pos is not None,
                  L2NORM=head_dim is not None, ACC=_acc(x.dtype), BT=BT, BD=BD, num_warps=4)
    return x, w, halo, pos, y


class ShortConvFn(torch.autograd.Function):
    """``(x [B, T, D], weight [D, W], bias [D] | None, halo [B, W-1, D] | None,
    pos [T] int | None, silu, head_dim | None) -> y [B, T, D]``; saves ``x``, ``halo`` and
    the parameters.  ``head_dim``: L2-normalise each head of that width after the activation."""

    @staticmethod
    def forward(ctx, x, weight, bias, halo, pos, silu, head_dim):
        x, w, halo, pos, y = _conv_forward(x, weight, bias, halo, pos, silu, head_dim)
        ctx.save_for_backward(x, w, bias, halo, pos)
        ctx.silu, ctx.head_dim, ctx.weight_shape = silu, head_dim, weight.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, bias, halo, pos = ctx.saved_tensors
        B, T, D = x.shape
        W = w.shape[-1]
        dy = dy.to(x.dtype).contiguous()
        BT, BD = _blocks(ctx.head_dim)
        n_t = cdiv(T + W - 1, BT)
        dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
        dhalo = None if halo is None else torch.empty_like(halo)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        dw_part = torch.empty(B * n_t, D, W, dtype=wide, device=x.device)
        db_part = None if bias is None else torch.empty(B * n_t, D, dtype=wide, device=x.device)
        _conv_bwd((n_t, cdiv(D, BD), B),
                  x, halo, w, bias, pos, dy, dx, dhalo, dw_part, db_part, T, D, x.stride(0),
                  x.stride(1), W=W, SILU=ctx.silu, HAS_HALO=halo is not None,
                  HAS_BIAS=bias is not None, HAS_POS=pos is not None,
                  L2NORM=ctx.head_dim is not None, ACC=_acc(x.dtype), BT=BT, BD=BD,
                  num_warps=4)
        dw = dw_part.sum(0).to(w.dtype).reshape(ctx.weight_shape)
        db = None if bias is None else db_part.sum(0).to(bias.dtype)
        return dx, dw, db, dhalo, None, None, None


def short_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
               halo: Optional[Tensor] = None, pos: Optional[Tensor] = None,
               activation: Optional[str] = "silu", l2norm_head_dim: Optional[int] = None
               ) -> Tensor:
    """Causal depthwise convolution of ``x [B, T, D]`` (unit channel stride, any token
    stride) with ``weight [D, 1, W]`` or ``[D, W]`` (``W <= 4``), in the dtype of ``x``.

    Args:
        bias: ``[D]`` or ``None``.
        halo: ``[B, W-1, D]``, the ``W-1`` tokens before ``x`` (``None``: zeros).
        pos: ``[T]`` int, each token's position in its packed sequence (``None``: one
            sequence per batch row).
        activation: ``"silu"``/``"swish"`` or ``None``.
        l2norm_head_dim: L2-normalise every head of this width after the activation
            (``y / sqrt(|y|^2 + 1e-6)``, FLA's q/k normalisation); a power of two
            up to 256 that divides ``D``.
    """
    W = weight.shape[-1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"weight: the kernel takes 1 to {MAX_WIDTH} taps, got {W}")
    if l2norm_head_dim is not None and not l2norm_supported(x.shape[-1], l2norm_head_dim):
        raise ValueError(f"l2norm_head_dim: expected a power of two up to 256 dividing "
                         f"{x.shape[-1]}, got {l2norm_head_dim}")
    if W == 1:
        halo = None
    silu = activation in ("silu", "swish")
    if differentiated(x, weight, bias, halo):
        return ShortConvFn.apply(x, weight, bias, halo, pos, silu, l2norm_head_dim)
    return _conv_forward(x, weight, bias, halo, pos, silu, l2norm_head_dim)[-1]


def l2norm_supported(D: int, head_dim: int) -> bool:
    """Whether the kernel can normalise heads of ``head_dim`` channels within ``D``."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and D % head_dim == 0


def short_conv_step(x: Tensor, cache: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                    activation: Optional[str] = "silu") -> Tensor:
    """One decoding step: ``x [B, D]``, ``cache [B, D, W]`` (the last ``W`` inputs, oldest
    first, FLA's conv state; updated in place) -> ``y [B, D]``.  No autograd."""
    B, D = x.shape
    W = weight.shape[-1]
    if tuple(cache.shape) != (B, D, W) or not cache.is_contiguous():
        raise ValueError(f"cache: expected a contiguous [B, D, W] = {[B, D, W]} tensor, got "
                         f"{list(cache.shape)}")
    y = torch.empty_like(x)
    _conv_step((cdiv(D, BLOCK_D), B),
               x.contiguous(), cache, weight.reshape(D, W).contiguous(), bias, y, D, W=W,
               SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None, BD=BLOCK_D)
    return y

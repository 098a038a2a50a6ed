"""Fused gate activations of the layers: one read of the projection, one write of the gate.

* :func:`logsigmoid_gate` -- GLA / Simple GLA: ``g = max(logsigmoid(x) / normalizer,
  clamp_min)`` in fp32 from a 16-bit (or fp32) projection ``x``;
* :func:`hgrn_gates` -- HGRN: ``f = logsigmoid(f_raw)`` (fp32; with a per-channel lower
  bound ``lb``: ``logaddexp(log lb, log1p(-lb) + logsigmoid(f_raw))``) and the input
  ``i = silu(i_raw) * (1 - exp(f))`` (dtype of ``i_raw``);
* :func:`gdn_gates` -- GatedDeltaNet: ``g = -exp(A_log) softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` (times 2 with negative eigenvalues), fp32, in one launch instead of
  about ten (the backward, on ``[B, T, H]`` tensors, stays PyTorch).

As PyTorch ops each is a chain of passes over the activation with fp32 temporaries (five to
eight reads and writes of a ``[B, T, D]`` tensor); here the forward reads the inputs once and
the backward recomputes the activations from the saved inputs.  Inputs may be strided views
with unit stride in the last dimension (e.g. splits of a fused projection); outputs are
contiguous.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, differentiated, next_pow2, tl, triton
from .jit_launch import KeptLaunches

BLOCK_R, BLOCK_C = 16, 128

if HAVE_TRITON:

    @triton.jit
    def _logsigmoid(x):
        """``min(x, 0) - log(1 + exp(-|x|))`` and ``sigmoid(-x)`` (its derivative)."""
        e = tl.exp(-tl.abs(x))
        ls = tl.minimum(x, 0.0) - tl.log(1.0 + e)
        sneg = tl.where(x >= 0, e / (1.0 + e), 1.0 / (1.0 + e))
        return ls, sneg

    @triton.jit
    def _offsets(R, C, sx, BR: tl.constexpr, BC: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (rows < R)[:, None] & (cols < C)[None, :]
        return rows[:, None] * sx + cols[None, :], rows[:, None] * C + cols[None, :], m

    @triton.jit
    def _logsigmoid_gate_fwd(x, y, R, C, sx, inv_norm, lo, HAS_CLAMP: tl.constexpr,
                             ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        ox, oy, m = _offsets(R, C, sx, BR, BC)
        ls, _ = _logsigmoid(tl.load(x + ox, mask=m, other=0.0).to(ACC))
        g = ls * inv_norm
        if HAS_CLAMP:
            g = tl.maximum(g, lo)
        tl.store(y + oy, g.to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _logsigmoid_gate_bwd(x, dy, dx, R, C, sx, inv_norm, lo, HAS_CLAMP: tl.constexpr,
                             ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        ox, oy, m = _offsets(R, C, sx, BR, BC)
        ls, sneg = _logsigmoid(tl.load(x + ox, mask=m, other=0.0).to(ACC))
        d = tl.load(dy + oy, mask=m, other=0.0).to(ACC) * sneg * inv_norm
        if HAS_CLAMP:
            d = tl.where(ls * inv_norm >= lo, d, 0.0)  # torch.clamp_min passes ties through
        tl.store(dx + oy, d.to(dx.dtype.element_ty), mask=m)

    @triton.jit
    def _hgrn_forget(f, lb, cols, mc, HAS_LB: tl.constexpr, ACC: tl.constexpr,
                     BC: tl.constexpr):
        """``g`` and ``dg/df`` (with a lower bound ``lb``:
        ``g = logaddexp(log lb, log1p(-lb) + logsigmoid(f))``), and ``lb``'s row ``[BC]``."""
        g, dgdf = _logsigmoid(f)
        lbv = tl.zeros([BC], dtype=ACC)
        if HAS_LB:
            lbv = tl.load(lb + cols, mask=mc, other=0.5).to(ACC)
            a = tl.log(lbv)[None, :]
            b = tl.log(1.0 - lbv)[None, :] + g
            hi = tl.maximum(a, b)
            g = hi + tl.log(1.0 + tl.exp(-tl.abs(a - b)))
            dgdf = tl.exp(b - g) * dgdf
        return g, dgdf, lbv

    @triton.jit
    def _hgrn_gates_fwd(i, f, lb, xo, go, R, C, si, sf, HAS_LB: tl.constexpr,
                        ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        oi, oo, m = _offsets(R, C, si, BR, BC)
        of, _, _ = _offsets(R, C, sf, BR, BC)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        iv = tl.load(i + oi, mask=m, other=0.0).to(ACC)
        g, _, _ = _hgrn_forget(tl.load(f + of, mask=m, other=0.0).to(ACC), lb, cols, cols < C,
                               HAS_LB, ACC, BC)
        # all in fp32, rounded once, as the layer's PyTorch path computes it
        xv = iv / (1.0 + tl.exp(-iv)) * (1.0 - tl.exp(g))
        tl.store(xo + oo, xv.to(xo.dtype.element_ty), mask=m)
        tl.store(go + oo, g.to(go.dtype.element_ty), mask=m)

    @triton.jit
    def _hgrn_gates_bwd(i, f, lb, dx, dg, di, df, dlb_part, R, C, si, sf, HAS_LB: tl.constexpr,
                        ACC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """``dlb_part [cdiv(R, BR), C]``: per-row-tile sums of the lower bound's gradient."""
        oi, oo, m = _offsets(R, C, si, BR, BC)
        of, _, _ = _offsets(R, C, sf, BR, BC)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        iv = tl.load(i + oi, mask=m, other=0.0).to(ACC)
        g, dgdf, lbv = _hgrn_forget(tl.load(f + of, mask=m, other=0.0).to(ACC), lb, cols,
                                    cols < C, HAS_LB, ACC, BC)
        dxv = tl.load(dx + oo, mask=m, other=0.0).to(ACC)
        dgv = tl.load(dg + oo, mask=m, other=0.0).to(ACC)
        s = 1.0 / (1.0 + tl.exp(-iv))
        eg = tl.exp(g)
        tl.store(di + oo, (dxv * (1.0 - eg) * s * (1.0 + iv * (1.0 - s))).to(di.dtype.element_ty),
                 mask=m)
        # x = silu(i) (1 - e^g): the total gradient of g adds dx * dx/dg = -dx silu(i) e^g
        dgt = dgv - dxv * iv * s * eg
        tl.store(df + oo, (dgt * dgdf).to(df.dtype.element_ty), mask=m)
        if HAS_LB:  # dg/dlb = e^(log lb - g) / lb - e^(log1p(-lb) + logsigmoid(f) - g) / (1 - lb)
            ls, _ = _logsigmoid(tl.load(f + of, mask=m, other=0.0).to(ACC))
            a = tl.log(lbv)[None, :]
            b = tl.log(1.0 - lbv)[None, :] + ls
            d = dgt * (tl.exp(a - g) / lbv[None, :] - tl.exp(b - g) / (1.0 - lbv)[None, :])
            tl.store(dlb_part + tl.program_id(0).to(tl.int64) * C + cols,
                     tl.sum(tl.where(m, d, 0.0), axis=0), mask=cols < C)


    _logsigmoid_fwd = KeptLaunches(_logsigmoid_gate_fwd)
    _logsigmoid_bwd = KeptLaunches(_logsigmoid_gate_bwd)
    _hgrn_fwd = KeptLaunches(_hgrn_gates_fwd)
    _hgrn_bwd = KeptLaunches(_hgrn_gates_bwd)


def _rows(t: Tensor) -> Tensor:
    """``[..., C]`` as ``[R, C]`` rows with unit column stride (a view where possible)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def _grid(R: int, C: int):
    return (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C))


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _wide(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logsigmoid_forward(x, normalizer, clamp_min):
    """The forward launch: ``(rows of x, y [..., C])``."""
    rows = _rows(x)
    R, C = rows.shape
    y = torch.empty(R, C, dtype=_wide(x.dtype), device=x.device)
    lo = 0.0 if clamp_min is None else float(clamp_min)
    if R and C:
        _logsigmoid_fwd(_grid(R, C), rows, y, R, C, rows.stride(0), 1.0 / normalizer, lo,
                        HAS_CLAMP=clamp_min is not None, ACC=_acc(x.dtype), BR=BLOCK_R,
                        BC=BLOCK_C)
    return rows, y.view(x.shape)


class _LogsigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalizer, clamp_min):
        rows, y = _logsigmoid_forward(x, normalizer, clamp_min)
        ctx.save_for_backward(rows)
        ctx.meta = (x.shape, normalizer, clamp_min)
        return y

    @staticmethod
    def backward(ctx, dy):
        (rows,) = ctx.saved_tensors
        shape, normalizer, clamp_min = ctx.meta
        R, C = rows.shape
        dx = torch.empty(R, C, dtype=rows.dtype, device=rows.device)
        lo = 0.0 if clamp_min is None else float(clamp_min)
        if R and C:
            _logsigmoid_bwd(_grid(R, C), rows, dy.contiguous(), dx, R, C, rows.stride(0),
                            1.0 / normalizer, lo, HAS_CLAMP=clamp_min is not None,
                            ACC=_acc(rows.dtype), BR=BLOCK_R, BC=BLOCK_C)
        return dx.view(shape), None, None


def logsigmoid_gate(x: Tensor, normalizer: float = 1.0,
                    clamp_min: Optional[float] = None) -> Tensor:
    """``max(logsigmoid(x) / normalizer, clamp_min)`` of ``x [..., C]``, fp32 (fp64 for fp64)."""
    if differentiated(x):
        return _LogsigmoidGate.apply(x, float(normalizer), clamp_min)
    return _logsigmoid_forward(x, float(normalizer), clamp_min)[1]


def _hgrn_forward(i, f, lower_bound):
    """The forward launch: ``(rows of i, rows of f, lb as read, x, g)``."""
    ri, rf = _rows(i), _rows(f)
    R, C = ri.shape
    wide = _wide(i.dtype)
    lb = None if lower_bound is None else lower_bound.to(wide).contiguous()
    x = torch.empty(R, C, dtype=i.dtype, device=i.device)
    g = torch.empty(R, C, dtype=wide, device=i.device)
    if R and C:
        _hgrn_fwd(_grid(R, C), ri, rf, lb, x, g, R, C, ri.stride(0), rf.stride(0),
                  HAS_LB=lb is not None, ACC=_acc(i.dtype), BR=BLOCK_R, BC=BLOCK_C)
    return ri, rf, lb, x.view(i.shape), g.view(i.shape)


class _HGRNGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, i, f, lower_bound):
        ri, rf, lb, x, g = _hgrn_forward(i, f, lower_bound)
        ctx.save_for_backward(ri, rf, lb)
        ctx.shape = i.shape
        ctx.lb_dtype = None if lower_bound is None else lower_bound.dtype
        return x, g

    @staticmethod
    def backward(ctx, dx, dg):
        ri, rf, lb = ctx.saved_tensors
        R, C = ri.shape
        wide = _wide(ri.dtype)
        dx = torch.zeros(R, C, dtype=ri.dtype, device=ri.device) if dx is None else dx
        dg = torch.zeros(R, C, dtype=wide, device=ri.device) if dg is None else dg
        di = torch.empty(R, C, dtype=ri.dtype, device=ri.device)
        df = torch.empty(R, C, dtype=rf.dtype, device=ri.device)
        grid = _grid(R, C)
        dlb_part = None if lb is None else torch.zeros(grid[0], C, dtype=wide, device=ri.device)
        if R and C:
            _hgrn_bwd(grid, ri, rf, lb, dx.contiguous(), dg.contiguous(), di, df, dlb_part,
                      R, C, ri.stride(0), rf.stride(0), HAS_LB=lb is not None,
                      ACC=_acc(ri.dtype), BR=BLOCK_R, BC=BLOCK_C)
        dlb = None if lb is None else dlb_part.sum(0).to(ctx.lb_dtype)
        return di.view(ctx.shape), df.view(ctx.shape), dlb


def hgrn_gates(i: Tensor, f: Tensor, lower_bound: Optional[Tensor] = None
               ) -> Tuple[Tensor, Tensor]:
    """HGRN's gates from the projections ``i, f [..., D]``: ``(silu(i) * (1 - exp(g)), g)``
    with ``g = logsigmoid(f)``, or with a lower bound ``lower_bound [D]`` (in ``(0, 1)``)
    ``g = logaddexp(log lb, log1p(-lb) + logsigmoid(f))``; the first in ``i``'s dtype, ``g``
    fp32 (fp64 for fp64)."""
    if i.shape != f.shape:
        raise ValueError(f"f: expected the shape of i {list(i.shape)}, got {list(f.shape)}")
    if lower_bound is not None and tuple(lower_bound.shape) != (i.shape[-1],):
        raise ValueError(f"lower_bound: expected [{i.shape[-1]}], got "
                         f"{list(lower_bound.shape)}")
    if differentiated(i, f, lower_bound):
        return _HGRNGates.apply(i, f, lower_bound)
    return _hgrn_forward(i, f, lower_bound)[3:]


if HAVE_TRITON:

    @triton.jit
    def _gdn_gates_fwd(a, b, A_log, dt_bias, g, beta, R, H, sa, sb, BETA_SCALE: tl.constexpr,
                       ACC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        h = tl.arange(0, BH)
        mh = h < H
        m = (rows < R)[:, None] & mh[None, :]
        av = tl.load(a + rows[:, None] * sa + h[None, :], mask=m, other=0.0).to(ACC)
        bv = tl.load(b + rows[:, None] * sb + h[None, :], mask=m, other=0.0).to(ACC)
        rate = tl.exp(tl.load(A_log + h, mask=mh, other=0.0).to(ACC))
        z = av + tl.load(dt_bias + h, mask=mh, other=0.0).to(ACC)[None, :]
        softplus = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))
        tl.store(g + rows[:, None] * H + h[None, :],
                 (-rate[None, :] * softplus).to(g.dtype.element_ty), mask=m)
        tl.store(beta + rows[:, None] * H + h[None, :],
                 (BETA_SCALE / (1.0 + tl.exp(-bv))).to(beta.dtype.element_ty), mask=m)


    _gdn_fwd = KeptLaunches(_gdn_gates_fwd)



def _gdn_forward(a, b, A_log, dt_bias, beta_scale):
    """The forward launch: ``(rows of a, g [R, H], beta [R, H])``."""
    ra, rb = _rows(a), _rows(b)
    R, H = ra.shape
    wide = _wide(a.dtype)
    g = torch.empty(R, H, dtype=wide, device=a.device)
    beta = torch.empty(R, H, dtype=wide, device=a.device)
    BH = next_pow2(H)
    BR = max(1, 2048 // BH)
    if R:
        _gdn_fwd((cdiv(R, BR),), ra, rb, A_log, dt_bias, g, beta, R, H, ra.stride(0),
                 rb.stride(0), BETA_SCALE=float(beta_scale), ACC=_acc(a.dtype), BR=BR, BH=BH)
    return ra, g, beta


class _GDNGates(torch.autograd.Function):
    """Forward one kernel; backward PyTorch ops on the small ``[N, H]`` tensors."""

    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, beta_scale):
        ra, g, beta = _gdn_forward(a, b, A_log, dt_bias, beta_scale)
        ctx.save_for_backward(ra, A_log, dt_bias, beta)
        ctx.meta = (a.shape, beta_scale, b.dtype)
        return g.view(a.shape), beta.view(a.shape)

    @staticmethod
    def backward(ctx, dg, dbeta):
        ra, A_log, dt_bias, beta = ctx.saved_tensors
        shape, beta_scale, b_dtype = ctx.meta
        wide = beta.dtype
        H = ra.shape[1]
        da = dA = ddt = db = None
        if dg is not None:
            dg = dg.reshape(-1, H).to(wide)
            z = ra.to(wide) + dt_bias.to(wide)
            rate = A_log.to(wide).exp()
            dz = -rate * torch.sigmoid(z) * dg
            da = dz.to(ra.dtype).view(shape)
            ddt = dz.sum(0).to(dt_bias.dtype)
            dA = (-rate * torch.nn.functional.softplus(z) * dg).sum(0).to(A_log.dtype)
        if dbeta is not None:
            s = beta / beta_scale
            db = (dbeta.reshape(-1, H).to(wide) * beta * (1 - s)).to(b_dtype).view(shape)
        return da, db, dA, ddt, None


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
              beta_scale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """GatedDeltaNet's gates from the projections ``a, b [..., H]``:
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = beta_scale * sigmoid(b)``, both
    fp32 (fp64 for fp64), forward in one kernel."""
    if a.shape != b.shape or a.shape[-1] != A_log.shape[0] or dt_bias.shape != A_log.shape:
        raise ValueError(f"a, b: expected [..., H] with H = {A_log.shape[0]} (A_log, dt_bias), "
                         f"got a {list(a.shape)}, b {list(b.shape)}, dt_bias "
                         f"{list(dt_bias.shape)}")
    if differentiated(a, b, A_log, dt_bias):
        return _GDNGates.apply(a, b, A_log, dt_bias, float(beta_scale))
    _, g, beta = _gdn_forward(a, b, A_log, dt_bias, float(beta_scale))
    return g.view(a.shape), beta.view(a.shape)

"""Fused (gated) RMS norm over rows, forward and backward, fp32 statistics.

Rows ``x [N, D]`` (any row stride, unit column stride) split into ``G`` groups of ``D / G``
columns; each group is normalised by its own RMS.  With ``weight [D]``, optional
``bias [D]`` and a gate ``g [N, D]``:

- ``GATE == 0`` (no gate):      ``y = x / rms(x) * weight + bias``
- gate after (FLA's ``FusedRMSNormGated``, Mamba2 with ``norm_before_gate``):
  ``y = (x / rms(x) * weight + bias) * act(g)``
- gate before (Mamba2's default ``RMSNormGated``): ``u = x * act(g)``, ``y = u / rms(u) * weight``

``act`` is swish (SiLU) or sigmoid.  One kernel reads ``x`` and ``g`` once and writes ``y``;
the forward keeps only the inputs and ``1/rms`` (``[N, G]`` fp32).  The backward recomputes
the rest and writes ``dx``, ``dg`` and per-program partial sums of ``dweight``/``dbias``
(each program walks a strided set of row tiles, so there are at most ``_MAX_PROGRAMS``
partials to add up).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, differentiated, next_pow2, tl, triton
from .jit_launch import KeptLaunches

#: gate codes for the kernels
NO_GATE, SWISH, SIGMOID = 0, 1, 2
ACTIVATIONS = {"swish": SWISH, "silu": SWISH, "sigmoid": SIGMOID}
#: elements of one tile (rows times group width)
_TILE = 4096
_MAX_PROGRAMS = 1024

if HAVE_TRITON:

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        """``act(g)`` and ``act'(g)``: swish (``ACT == 1``) or sigmoid."""
        s = 1.0 / (1.0 + tl.exp(-g))
        if ACT == 1:
            a = g * s
            slope = s * (1.0 + g * (1.0 - s))
        else:
            a = s
            slope = s * (1.0 - s)
        return a, slope

    @triton.jit
    def _gated_norm_fwd_kernel(x, g, w, bias, y, rstd, N, D, GS, sx, sg, eps,
                               ACT: tl.constexpr, GATE_BEFORE: tl.constexpr,
                               HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
                               BR: tl.constexpr, BC: tl.constexpr):
        """Grid ``(cdiv(N, BR), G)``; ``y`` contiguous ``[N, D]``, ``rstd [N, G]``."""
        pr, grp = tl.program_id(0), tl.program_id(1)
        rows = (pr * BR + tl.arange(0, BR)).to(tl.int64)
        cols = grp * GS + tl.arange(0, BC)
        mr, mc = rows < N, tl.arange(0, BC) < GS
        m = mr[:, None] & mc[None, :]
        xv = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m, other=0.0).to(ACC)
        if ACT != 0:
            gv = tl.load(g + rows[:, None] * sg + cols[None, :], mask=m, other=0.0).to(ACC)
            a, _ = _act(gv, ACT)
            if GATE_BEFORE:
                xv = xv * a
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / GS + eps)
        out = xv * r[:, None]
        if HAS_W:
            out = out * tl.load(w + cols, mask=mc, other=0.0).to(ACC)[None, :]
        if HAS_B:
            out = out + tl.load(bias + cols, mask=mc, other=0.0).to(ACC)[None, :]
        if ACT != 0 and not GATE_BEFORE:
            out = out * a
        tl.store(y + rows[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=m)
        tl.store(rstd + rows * (D // GS) + grp, r.to(rstd.dtype.element_ty), mask=mr)

    @triton.jit
    def _gated_norm_bwd_kernel(x, g, w, bias, rstd, dy, dx, dg, dw_part, db_part, N, D, GS,
                               sx, sg, ACT: tl.constexpr, GATE_BEFORE: tl.constexpr,
                               HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
                               BR: tl.constexpr, BC: tl.constexpr):
        """Grid ``(P, G)``: program ``p`` takes row tiles ``p, p + P, ...``; ``dw_part`` and
        ``db_part`` ``[P, D]``."""
        pr, grp = tl.program_id(0), tl.program_id(1)
        P = tl.num_programs(0)
        cols = grp * GS + tl.arange(0, BC)
        mc = tl.arange(0, BC) < GS
        if HAS_W:
            wv = tl.load(w + cols, mask=mc, other=0.0).to(ACC)
        if HAS_B:
            bv = tl.load(bias + cols, mask=mc, other=0.0).to(ACC)
        dw_acc = tl.zeros([BC], dtype=ACC)
        db_acc = tl.zeros([BC], dtype=ACC)
        for tile in range(pr, tl.cdiv(N, BR), P):
            rows = (tile * BR + tl.arange(0, BR)).to(tl.int64)
            mr = rows < N
            m = mr[:, None] & mc[None, :]
            xv = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m, other=0.0).to(ACC)
            d = tl.load(dy + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(ACC)
            r = tl.load(rstd + rows * (D // GS) + grp, mask=mr, other=0.0).to(ACC)
            if ACT != 0:
                gv = tl.load(g + rows[:, None] * sg + cols[None, :], mask=m,
                             other=0.0).to(ACC)
                a, slope = _act(gv, ACT)
            if GATE_BEFORE:
                u = xv * a
            else:
                u = xv
            uhat = u * r[:, None]
            if ACT != 0 and not GATE_BEFORE:
                pre = uhat
                if HAS_W:
                    pre = pre * wv[None, :]
                if HAS_B:
                    pre = pre + bv[None, :]
                tl.store(dg + rows[:, None] * D + cols[None, :],
                         (d * pre * slope).to(dg.dtype.element_ty), mask=m)
                d = d * a
            if HAS_B:
                db_acc += tl.sum(d, axis=0)
            if HAS_W:
                dw_acc += tl.sum(d * uhat, axis=0)
                d = d * wv[None, :]
            du = r[:, None] * (d - uhat * (tl.sum(d * uhat, axis=1) / GS)[:, None])
            if GATE_BEFORE:
                tl.store(dg + rows[:, None] * D + cols[None, :],
                         (du * xv * slope).to(dg.dtype.element_ty), mask=m)
                du = du * a
            tl.store(dx + rows[:, None] * D + cols[None, :], du.to(dx.dtype.element_ty),
                     mask=m)
        if HAS_W:
            tl.store(dw_part + pr.to(tl.int64) * D + cols, dw_acc, mask=mc)
        if HAS_B:
            tl.store(db_part + pr.to(tl.int64) * D + cols, db_acc, mask=mc)


    _norm_fwd = KeptLaunches(_gated_norm_fwd_kernel)
    _norm_bwd = KeptLaunches(_gated_norm_bwd_kernel)


def _tiles(group_size: int):
    """(rows per tile, columns per tile) for a group width."""
    bc = next_pow2(group_size)
    return max(1, min(64, _TILE // bc)), bc


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _norm_forward(x, g, weight, bias, eps, act, gate_before, groups):
    """The forward launch; returns ``x`` and ``g`` as read, the activation code and
    ``gate_before`` as applied, ``y`` and ``rstd`` (what the backward keeps)."""
    x = _rows(x)
    g = None if g is None else _rows(g)
    gate_before = gate_before and g is not None  # no gate: a plain norm
    act = act if g is not None else NO_GATE
    N, D = x.shape
    GS = D // groups
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    rstd = torch.empty(N, groups, dtype=wide, device=x.device)
    BR, BC = _tiles(GS)
    if N:
        _norm_fwd((cdiv(N, BR), groups),
                  x, g, weight, bias, y, rstd, N, D, GS, x.stride(0),
                  0 if g is None else g.stride(0), eps, ACT=act, GATE_BEFORE=gate_before,
                  HAS_W=weight is not None, HAS_B=bias is not None, ACC=_acc_dtype(x.dtype),
                  BR=BR, BC=BC, num_warps=4 if BC <= 1024 else 8)
    return x, g, act, gate_before, y, rstd


class GatedRMSNormFn(torch.autograd.Function):
    """``(x [N, D], g [N, D] | None, weight [D] | None, bias [D] | None, eps, act code,
    gate_before, groups) -> y [N, D]`` (dtype of ``x``); saves the inputs and ``rstd``."""

    @staticmethod
    def forward(ctx, x, g, weight, bias, eps, act, gate_before, groups):
        x, g, act, gate_before, y, rstd = _norm_forward(x, g, weight, bias, eps, act,
                                                        gate_before, groups)
        ctx.save_for_backward(x, g, weight, bias, rstd)
        ctx.meta = (act, gate_before, groups)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, weight, bias, rstd = ctx.saved_tensors
        act, gate_before, groups = ctx.meta
        N, D = x.shape
        GS = D // groups
        BR, BC = _tiles(GS)
        P = max(1, min(_MAX_PROGRAMS, cdiv(N, BR)))
        dy = dy.to(x.dtype).contiguous()
        dx = torch.empty(N, D, dtype=x.dtype, device=x.device)
        dg = None if g is None else torch.empty(N, D, dtype=g.dtype, device=x.device)
        wide = rstd.dtype
        dw_part = None if weight is None else torch.zeros(P, D, dtype=wide, device=x.device)
        db_part = None if bias is None else torch.zeros(P, D, dtype=wide, device=x.device)
        if N:
            _norm_bwd((P, groups),
                      x, g, weight, bias, rstd, dy, dx, dg, dw_part, db_part, N, D, GS,
                      x.stride(0), 0 if g is None else g.stride(0), ACT=act,
                      GATE_BEFORE=gate_before, HAS_W=weight is not None,
                      HAS_B=bias is not None, ACC=_acc_dtype(x.dtype), BR=BR, BC=BC,
                      num_warps=4 if BC <= 1024 else 8)
        dw = None if weight is None else dw_part.sum(0).to(weight.dtype)
        db = None if bias is None else db_part.sum(0).to(bias.dtype)
        return dx, dg, dw, db, None, None, None, None


def gated_rms_norm(x: Tensor, g: Optional[Tensor], weight: Optional[Tensor],
                   bias: Optional[Tensor] = None, eps: float = 1e-5,
                   activation: str = "swish", gate_before: bool = False,
                   groups: int = 1) -> Tensor:
    """The fused norm of ``x [..., D]`` (gate ``g`` of ``x``'s shape or ``None``) in the
    dtype of ``x``; see the module docstring for the formulas."""
    shape = x.shape
    D = shape[-1]
    rows = x.reshape(-1, D)
    gate = None if g is None else g.reshape(-1, D)
    act = ACTIVATIONS[activation] if g is not None else NO_GATE
    if differentiated(x, g, weight, bias):
        y = GatedRMSNormFn.apply(rows, gate, weight, bias, float(eps), act, bool(gate_before),
                                 int(groups))
    else:
        y = _norm_forward(rows, gate, weight, bias, float(eps), act, bool(gate_before),
                          int(groups))[4]
    return y.reshape(shape)

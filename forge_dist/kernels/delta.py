"""Delta rule (dense transitions): gated_delta_rule (``g [B, T, H]``) and DeltaNet (``g=None``).

Two launches (see :mod:`forge_dist.variants.delta_rule` for the chunk equations):

1. ``_wy_kernel``, per chunk in parallel: the unit lower-triangular inverse
   ``Tm = (I + diag(b) Lmat)^{-1}``, blocked: forward substitution on 16-row diagonal blocks
   (stable for aligned keys), the blocks below on tensor cores; then
   ``W = Tm diag(b exp(G)) K`` and ``U = Tm diag(b) V`` on tensor cores;
2. the shared fused walker with the WY correction ``v' = U - W S``.

The summary's dense transition ``M`` is the same walk started from ``S = I`` with ``U = 0``
(columns of the state are independent, so the walk carries the identity's columns).  For
16-bit inputs it uses the forward's operands and WY factors (see :func:`summary_precision`
for the fp32 option); fp32 inputs use fp32 operands with 3xTF32 dots.
"""
from __future__ import annotations

import os

import torch

from ._common import (HAVE_TRITON, dot_precision, ensure, grad_like, next_pow2,
                      sized_config, tl, triton, TritonWork, walk)
from ..variants import delta_rule

# BV=32: twice the programs of 64 (B*H*V/BV), 10 % faster at 16K and 64K tokens on H200
# (results/kernel_profile_*); 128 or 8 warps are slower.
FUSED_CONFIG = {"BT": 64, "BV": 32, "num_warps": 4, "num_stages": 2}
WY_CONFIG = {"BV": 64, "num_warps": 4, "num_stages": 1}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims."""
    return sized_config(FUSED_CONFIG, K)


if HAVE_TRITON:

    @triton.jit
    def _wy_rows(k, g, beta, bos, r0, T, i_h, g_off, H: tl.constexpr, K: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr):
        """Rows ``[r0, r0 + BC)`` of a chunk: keys ``[BC, BK]``, beta ``[BC]``, the cumulative
        log decay ``G [BC]`` continuing from ``g_off`` (the chunk's sum before r0), and the
        sum through the block's last row."""
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (r0, 0), (BC, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        o_t = r0 + tl.arange(0, BC)
        b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=o_t < T, other=0.0).to(tl.float32)
        if GATE == 1:
            b_g = tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T, other=0.0).to(tl.float32)
            b_G = tl.cumsum(b_g, axis=0) + g_off
            g_end = g_off + tl.sum(b_g, axis=0)
        else:
            b_G = tl.zeros([BC], dtype=tl.float32)
            g_end = g_off
        return b_k, b_b, b_G, g_end

    @triton.jit
    def _wy_block(ki, bi, Gi, kj, Gj, PREC: tl.constexpr, GATE: tl.constexpr):
        """``A_ij = diag(b_i) (k_i k_j^T * exp(G_i - G_j))`` for a block strictly below the
        diagonal (every row after every column, so the exponent is never positive)."""
        a = tl.dot(ki, tl.trans(kj), input_precision=PREC)
        if GATE == 1:
            a = a * tl.exp(Gi[:, None] - Gj[None, :])
        return a * bi[:, None]

    @triton.jit
    def _unit_lower_inverse(a, BC: tl.constexpr):
        """``(I + a)^{-1}`` of a strictly lower ``[BC, BC]`` block by forward substitution,
        row by row: ``x_i = e_i - a_i X`` (rows before i are final when row i is formed)."""
        rows = tl.arange(0, BC)
        x = tl.zeros([BC, BC], dtype=tl.float32)
        for i in tl.static_range(BC):
            sel = rows == i
            a_i = tl.sum(tl.where(sel[:, None], a, 0.0), axis=0)
            x_i = tl.where(sel, 1.0, 0.0) - tl.sum(a_i[:, None] * x, axis=0)
            x = tl.where(sel[:, None], x_i[None, :], x)
        return x

    @triton.jit
    def _load_rows(base, T, N: tl.constexpr, r0, c0, H: tl.constexpr, BC: tl.constexpr,
                   BN: tl.constexpr):
        """Rows ``[r0, r0 + BC)``, columns ``[c0, c0 + BN)`` of a head's ``[T, N]`` slice
        (token stride ``H * N``), as fp32."""
        p = tl.make_block_ptr(base, (T, N), (H * N, 1), (r0, c0), (BC, BN), (1, 0))
        return tl.load(p, boundary_check=(0, 1)).to(tl.float32)

    @triton.jit
    def _store_block(base, T, N: tl.constexpr, r0, c0, y, H: tl.constexpr, BC: tl.constexpr,
                     BN: tl.constexpr):
        """Store a ``[BC, BN]`` block at rows ``[r0, r0 + BC)``, columns from ``c0`` of a
        head's ``[T, N]`` slice (token stride ``H * N``)."""
        p = tl.make_block_ptr(base, (T, N), (H * N, 1), (r0, c0), (BC, BN), (1, 0))
        tl.store(p, y.to(p.dtype.element_ty), boundary_check=(0, 1))

    @triton.jit
    def _store_rows(base, T, N: tl.constexpr, t0, c0, y0, y1, y2, y3, H: tl.constexpr,
                    BC: tl.constexpr, BN: tl.constexpr):
        """Store four ``[BC, BN]`` row blocks at rows ``t0, t0 + BC, ...``, columns from
        ``c0``."""
        _store_block(base, T, N, t0, c0, y0, H, BC, BN)
        _store_block(base, T, N, t0 + BC, c0, y1, H, BC, BN)
        _store_block(base, T, N, t0 + 2 * BC, c0, y2, H, BC, BN)
        _store_block(base, T, N, t0 + 3 * BC, c0, y3, H, BC, BN)

    @triton.jit
    def _lower_times(x00, x10, x11, x20, x21, x22, x30, x31, x32, x33, r0, r1, r2, r3,
                     PREC: tl.constexpr):
        """``X R`` for a block lower-triangular ``X`` (4 x 4 blocks) and ``R`` given as its
        four row blocks; returns the four row blocks of the product."""
        y0 = tl.dot(x00, r0, input_precision=PREC)
        y1 = tl.dot(x10, r0, input_precision=PREC) + tl.dot(x11, r1, input_precision=PREC)
        y2 = (tl.dot(x20, r0, input_precision=PREC) + tl.dot(x21, r1, input_precision=PREC)
              + tl.dot(x22, r2, input_precision=PREC))
        y3 = (tl.dot(x30, r0, input_precision=PREC) + tl.dot(x31, r1, input_precision=PREC)
              + tl.dot(x32, r2, input_precision=PREC) + tl.dot(x33, r3, input_precision=PREC))
        return y0, y1, y2, y3

    @triton.jit
    def _wy_kernel(k, v, g, beta, w, u, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, PREC: tl.constexpr, STORE_X: tl.constexpr = False,
                   xs=None):
        """grid ``(NT, B * H)``; k, w [B, T, H, K]; v, u [B, T, H, V]; g, beta [B, T, H];
        STORE_X (for the backward): the inverse into ``xs [B, T, H, BT]`` fp32, row ``i`` of
        a chunk at its token ``i`` (the blocks above the diagonal are left untouched: zero).

        ``X = (I + A)^{-1}`` per chunk of ``BT = 64`` tokens, blocked in four 16-row blocks:
        the diagonal blocks by forward substitution on 16 x 16 (stable for aligned keys,
        where a product of powers of A cancels catastrophically), the blocks below them by
        ``X_ij = -X_ii sum_{j <= m < i} A_im X_mj`` on tensor cores.  Then
        ``W = X diag(b exp(G)) K`` and ``U = X diag(b) V``.
        """
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets pass 2**31 at long T
        bos = i_b * T
        t0 = i_t * BT
        BC: tl.constexpr = BT // 4
        rows = tl.arange(0, BC)
        strict = rows[:, None] > rows[None, :]
        zero = tl.full((), 0.0, tl.float32)
        k0, b0, G0, s0 = _wy_rows(k, g, beta, bos, t0, T, i_h, zero, H, K, BC, BK, GATE)
        k1, b1, G1, s1 = _wy_rows(k, g, beta, bos, t0 + BC, T, i_h, s0, H, K, BC, BK, GATE)
        k2, b2, G2, s2 = _wy_rows(k, g, beta, bos, t0 + 2 * BC, T, i_h, s1, H, K, BC, BK, GATE)
        k3, b3, G3, s3 = _wy_rows(k, g, beta, bos, t0 + 3 * BC, T, i_h, s2, H, K, BC, BK, GATE)
        # diagonal blocks: strictly lower part of diag(b) (k k^T * exp(G_i - G_j))
        d0 = tl.dot(k0, tl.trans(k0), input_precision=PREC)
        d1 = tl.dot(k1, tl.trans(k1), input_precision=PREC)
        d2 = tl.dot(k2, tl.trans(k2), input_precision=PREC)
        d3 = tl.dot(k3, tl.trans(k3), input_precision=PREC)
        if GATE == 1:
            d0 = d0 * tl.exp(tl.where(strict, G0[:, None] - G0[None, :], float("-inf")))
            d1 = d1 * tl.exp(tl.where(strict, G1[:, None] - G1[None, :], float("-inf")))
            d2 = d2 * tl.exp(tl.where(strict, G2[:, None] - G2[None, :], float("-inf")))
            d3 = d3 * tl.exp(tl.where(strict, G3[:, None] - G3[None, :], float("-inf")))
        x00 = _unit_lower_inverse(tl.where(strict, d0, 0.0) * b0[:, None], BC)
        x11 = _unit_lower_inverse(tl.where(strict, d1, 0.0) * b1[:, None], BC)
        x22 = _unit_lower_inverse(tl.where(strict, d2, 0.0) * b2[:, None], BC)
        x33 = _unit_lower_inverse(tl.where(strict, d3, 0.0) * b3[:, None], BC)
        a10 = _wy_block(k1, b1, G1, k0, G0, PREC, GATE)
        a20 = _wy_block(k2, b2, G2, k0, G0, PREC, GATE)
        a21 = _wy_block(k2, b2, G2, k1, G1, PREC, GATE)
        a30 = _wy_block(k3, b3, G3, k0, G0, PREC, GATE)
        a31 = _wy_block(k3, b3, G3, k1, G1, PREC, GATE)
        a32 = _wy_block(k3, b3, G3, k2, G2, PREC, GATE)
        x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PREC), input_precision=PREC)
        x21 = -tl.dot(x22, tl.dot(a21, x11, input_precision=PREC), input_precision=PREC)
        x20 = -tl.dot(x22, tl.dot(a20, x00, input_precision=PREC)
                      + tl.dot(a21, x10, input_precision=PREC), input_precision=PREC)
        x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=PREC), input_precision=PREC)
        x31 = -tl.dot(x33, tl.dot(a31, x11, input_precision=PREC)
                      + tl.dot(a32, x21, input_precision=PREC), input_precision=PREC)
        x30 = -tl.dot(x33, tl.dot(a30, x00, input_precision=PREC)
                      + tl.dot(a31, x10, input_precision=PREC)
                      + tl.dot(a32, x20, input_precision=PREC), input_precision=PREC)
        if STORE_X:
            base_x = xs + (bos * H + i_h) * BT
            _store_rows(base_x, T, BT, t0, 0, x00, x10, x20, x30, H, BC, BC)
            _store_block(base_x, T, BT, t0 + BC, BC, x11, H, BC, BC)
            _store_block(base_x, T, BT, t0 + 2 * BC, BC, x21, H, BC, BC)
            _store_block(base_x, T, BT, t0 + 3 * BC, BC, x31, H, BC, BC)
            _store_block(base_x, T, BT, t0 + 2 * BC, 2 * BC, x22, H, BC, BC)
            _store_block(base_x, T, BT, t0 + 3 * BC, 2 * BC, x32, H, BC, BC)
            _store_block(base_x, T, BT, t0 + 3 * BC, 3 * BC, x33, H, BC, BC)
        # W = X diag(b exp(G)) K, row block by row block
        w0, w1, w2, w3 = _lower_times(
            x00, x10, x11, x20, x21, x22, x30, x31, x32, x33,
            k0.to(tl.float32) * (b0 * tl.exp(G0))[:, None],
            k1.to(tl.float32) * (b1 * tl.exp(G1))[:, None],
            k2.to(tl.float32) * (b2 * tl.exp(G2))[:, None],
            k3.to(tl.float32) * (b3 * tl.exp(G3))[:, None], PREC)
        _store_rows(w + (bos * H + i_h) * K, T, K, t0, 0, w0, w1, w2, w3, H, BC, BK)
        # U = X diag(b) V, per V tile
        base_v = v + (bos * H + i_h) * V
        for v0 in range(0, V, BV):
            u0, u1, u2, u3 = _lower_times(
                x00, x10, x11, x20, x21, x22, x30, x31, x32, x33,
                _load_rows(base_v, T, V, t0, v0, H, BC, BV) * b0[:, None],
                _load_rows(base_v, T, V, t0 + BC, v0, H, BC, BV) * b1[:, None],
                _load_rows(base_v, T, V, t0 + 2 * BC, v0, H, BC, BV) * b2[:, None],
                _load_rows(base_v, T, V, t0 + 3 * BC, v0, H, BC, BV) * b3[:, None], PREC)
            _store_rows(u + (bos * H + i_h) * V, T, V, t0, v0, u0, u1, u2, u3, H, BC, BV)


def wy(k, v, g, beta, *, BT: int, prec: str, dtype, store_x: bool = False):
    """``(W [B, T, H, K], U [B, T, H, V])`` in ``dtype``; chunks of ``BT = 64`` tokens.
    ``store_x``: also the per-chunk inverse ``X [B, T, H, BT]`` fp32 (a third result)."""
    if BT != 64:
        raise ValueError(f"wy: the blocked inverse works on chunks of 64 tokens, got BT={BT}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    w = torch.empty(B, T, H, K, dtype=dtype, device=k.device)
    u = torch.empty(B, T, H, V, dtype=dtype, device=k.device)
    xs = torch.zeros(B, T, H, BT, dtype=torch.float32, device=k.device) if store_x else None
    _wy_kernel[(triton.cdiv(T, BT), B * H)](
        k, v, g if g is not None else beta, beta, w, u, T, H=H, K=K, V=V, BT=BT,
        BK=next_pow2(K), BV=min(WY_CONFIG["BV"], next_pow2(V)),
        GATE=0 if g is None else 1, PREC=prec, STORE_X=store_x, xs=xs,
        num_warps=WY_CONFIG["num_warps"], num_stages=WY_CONFIG["num_stages"])
    return (w, u, xs) if store_x else (w, u)


def summary_precision() -> str:
    """``FORGE_DIST_DENSE_SUMMARY``: ``input`` (default) computes a 16-bit shard's summary
    (delta and the dense M) with the forward's own operands and shares the forward's WY
    factors; ``fp32`` computes it from fp32 copies with 3xTF32 dots (about 5x slower at the
    weak-scaling shard, ``results/gdn_pieces_*.json``: relative error of ``M S + delta``
    2e-7 instead of 2.7e-3, which is the bf16 forward's own level)."""
    raw = os.environ.get("FORGE_DIST_DENSE_SUMMARY", "").strip().lower() or "input"
    if raw not in ("input", "fp32"):
        raise ValueError(f"FORGE_DIST_DENSE_SUMMARY: expected 'input' or 'fp32', got {raw!r}")
    return raw


class DeltaRuleWork(TritonWork):
    """gated_delta_rule segment: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``g [B, T, H]`` or ``None``, ``beta [B, T, H]``.

    The WY factors ``(W, U)`` depend only on the segment's inputs: computed once (by
    ``prepare``, ``summary`` or ``finish``, whichever runs first) and shared.
    """

    names = ("q", "k", "v", "g", "beta")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._wy = None

    def _wy_factors(self, k, v, g, beta, cfg):
        """``(W, U)`` in the input dtype: bf16/fp16 inputs use TF32 for the WY products,
        fp32 inputs stay fp32 (3xTF32)."""
        if self._wy is None:
            low = k.dtype in (torch.float16, torch.bfloat16)
            prec = "tf32" if low and dot_precision(k.dtype) != "ieee" else dot_precision(k.dtype)
            self._wy = wy(k, v, g, beta, BT=cfg["BT"], prec=prec, dtype=k.dtype)
        return self._wy

    def release(self) -> None:
        super().release()
        self._wy = None

    def prepare(self) -> None:
        """The WY factors before the incoming state arrives (they need no state)."""
        if self._wy is None:
            with torch.no_grad():
                _, k, v, g, beta = (ensure(None if t is None else t.detach())
                                    for t in self.tensors)
                self._wy_factors(k, v, g, beta, fused_config(k.shape[-1], v.shape[-1]))

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        self.execution, self.execution_reason = "fused", "decoupled not built for this pattern"
        w, u = self._wy_factors(k, v, g, beta, cfg)
        return walk(k, u, q=q, g=g, gate=0 if g is None else 1, w=w, h0=S_in, scale=self.scale,
                    out_dtype=self.out_dtype, cfg=cfg, prec=dot_precision(k.dtype))

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        if k.dtype == torch.float32 or summary_precision() == "fp32":
            prec = dot_precision(torch.float32)
            k, v = k.to(torch.float32), v.to(torch.float32)
            w, u = wy(k, v, g, beta, BT=cfg["BT"], prec=prec, dtype=torch.float32)
        else:  # the forward's operands: the WY factors are shared with finish()
            prec = dot_precision(k.dtype)
            w, u = self._wy_factors(k, v, g, beta, cfg)
        gate = 0 if g is None else 1
        _, delta = walk(k, u, g=g, gate=gate, w=w, cfg=cfg, prec=prec)
        M = None
        if need_M:
            B, T, H, K = k.shape
            eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, H, K, K)
            _, M = walk(k, None, V=K, g=g, gate=gate, w=w, h0=eye, cfg=cfg, prec=prec)
        return delta, M

    # Triton backward (kernels/delta_backward.py) -----------------------------------------
    def _finish_bwd(self, S_in, tensors, do, dht):
        from .delta_backward import delta_rule_backward

        q, k, v, g, beta = (ensure(t) for t in tensors)
        dq, dk, dv, dg, dbeta, dS = delta_rule_backward(q, k, v, g, beta, S_in, do, dht,
                                                        self.scale)
        return [dS, dq, dk, dv, grad_like(dg, tensors[3]), grad_like(dbeta, tensors[4])]

    def _summary_bwd(self, tensors, ddelta, dM):
        """``delta`` is the end state from a zero start and ``M`` the end state of the same
        walk from ``I`` with no values; the state's columns are independent, so both run as
        one backward over the values ``[v | 0]`` from ``[0 | I]``."""
        from .delta_backward import delta_rule_backward

        q, k, v, g, beta = (ensure(t) for t in tensors)
        B, T, H, K = k.shape
        V = v.shape[-1]
        f32 = torch.float32
        if ddelta is None:
            ddelta = torch.zeros(B, H, K, V, dtype=f32, device=k.device)
        if dM is None:
            _, dk, dv, dg, dbeta, _ = delta_rule_backward(q, k, v, g, beta, None, None,
                                                          ddelta, self.scale)
        else:
            values = torch.cat([v, torch.zeros(B, T, H, K, dtype=v.dtype, device=v.device)], -1)
            S0 = torch.cat([torch.zeros(B, H, K, V, dtype=f32, device=k.device),
                            torch.eye(K, dtype=f32, device=k.device).expand(B, H, K, K)], -1)
            dST = torch.cat([ddelta.to(f32), dM.to(f32)], -1)
            _, dk, dvals, dg, dbeta, _ = delta_rule_backward(q, k, values, g, beta, S0, None,
                                                             dST, self.scale)
            dv = dvals[..., :V]
        return [torch.zeros_like(q), dk, dv, grad_like(dg, tensors[3]),
                grad_like(dbeta, tensors[4])]

    def _summary_torch(self, tensors, need_M):
        q, k, v, g, beta = tensors
        return delta_rule.summarize(q, k, v, g, beta, self.scale, need_transition=need_M)

"""Delta rule (dense transitions): gated_delta_rule (``g [B, T, H]``) and DeltaNet (``g=None``).

Two stages (see :mod:`forge_dist.variants.delta_rule` for the chunk equations):

1. the WY factors, per chunk of 64 tokens in parallel (``_wy_kernel``, :func:`wy`): the unit
   lower-triangular inverse ``X = (I + A)^{-1}``, ``A = diag(b) Lmat``, blocked (forward
   substitution on the four 16-row diagonal blocks, stable for aligned keys; the blocks below
   them by block substitution on tensor cores), stored as ``X [B, T, H, 64]``; then
   ``W = X diag(b exp(G)) K`` and ``U = X diag(b) V``, one ``[64, 64] x [64, N]`` product per
   tile;
2. the shared fused walker with the WY correction ``v' = U - W S``.

The summary's dense transition ``M`` is the same walk started from ``S = I`` with ``U = 0``
(columns of the state are independent, so the walk carries the identity's columns).  For
16-bit inputs it uses the forward's operands and WY factors (see :func:`forge_dist.kernels.summary_precision`
for the fp32 option); fp32 inputs use fp32 operands with 3xTF32 dots.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import scheduler, summary_precision
from .compat import (HAVE_TRITON, dot_precision, ensure, env_tiles, grad_like, next_pow2,
                     sized_config, tl, triton)
from .ir import MAIN, SIDE, Buffer, KernelSpec, Launch, Program, run_launch, tl_type
from .tiles import reset_floor
from .walker import walk, walker_gates
from .walker_launches import (FOLDED, NO_SUMMARY, STATE, gate_cumsum, matrix_buffers,
                              walk_launch, walk_launches)
from .work import TritonWork
from ..config import env_positive_int
from ..variants import delta_rule

DENSE_SUMMARIES = (NO_SUMMARY, STATE, FOLDED)  # the delta rule's summary= forms

# The walker reads the in-chunk attention the WY launch formed (HAS_A).  Measured on H200 at
# T=64K, B=1, H=32, K=V=128 bf16, whole forward (results/kernel_profile_walkers2_2026-11-24):
# BV=32, 4 warps: 3 pipeline stages 3.36 ms, 2 stages 4.25, 1 stage 5.75; BV=64 with 3
# stages 3.71; BV=16 with 2 warps 4.15.  The walk is latency bound (its programs barely fill
# the SMs), so loads issued three chunks ahead pay.  16-bit operands only: three stages of
# fp32 q, k, w tiles overflow shared memory (FUSED_CONFIG's 2 stages apply there).
FUSED_CONFIG = {"BT": 64, "BV": 32, "num_warps": 4, "num_stages": 2}

# The WY factors (``wy``).  fused: one launch runs both phases (the program writes X and
# reads it back); else two launches: the inverse with ``solve_warps`` and ``solve_stages``
# (its 16 x 16 substitution is latency bound: one warp, many programs per SM), then W and U
# with ``num_warps`` and ``num_stages``.  solve_BK: the K tile of the k k^T sums (16-bit
# elements; fp32 keys take half); BK, BV: the W, U tiles.  x_dtype "input": bf16 inputs keep
# X in bf16 and form W, U from bf16 operands (fp32 accumulation, as FLA does); "fp32": X in
# fp32 and TF32 products.  fp16 and fp32 inputs, and the backward's X, are always fp32.
# Measured on H200 at T=64K, B=1, H=32, K=V=128 bf16 (results/wy_probe_*_2026-11-24.json):
# solve 0.59 ms with 2 stages (0.73 with 1), apply 0.68 ms with 128-wide tiles (0.74 at 64);
# one fused launch 3.3 ms; the previous single kernel 4.7 ms; FLA's kk^T + solve + W, U 1.54.
WY_CONFIG = {"fused": False, "solve_warps": 1, "solve_stages": 2, "solve_BK": 32,
             "x_dtype": "input", "BK": 128, "BV": 128, "num_warps": 4, "num_stages": 1}
WY_BT = 64  # the blocked inverse's chunk: four 16-row blocks


LOW_PRECISION_STAGES = 3


def fused_config(K: int, V: int, dtype: torch.dtype = torch.float32) -> dict:
    """The fused walker's tiles for this pattern, head dims and operand dtype (at K = 256 one
    pipeline stage: q, k and w tiles of two stages need 238 KB of shared memory, over sm_90's
    227 KB per block; 16-bit operands below that: ``LOW_PRECISION_STAGES``)."""
    cfg = sized_config(FUSED_CONFIG, K)
    if next_pow2(K) >= 256:
        cfg["num_stages"] = 1
    elif dtype in (torch.float16, torch.bfloat16):
        cfg["num_stages"] = LOW_PRECISION_STAGES
    return cfg


if HAVE_TRITON:

    @triton.jit
    def _wy_gates(g, beta, bos, r0, T, i_h, g_off, H: tl.constexpr, BC: tl.constexpr,
                  GATE: tl.constexpr):
        """Rows ``[r0, r0 + BC)`` of a chunk: beta ``[BC]``, the cumulative log decay
        ``G [BC]`` continuing from ``g_off`` (the chunk's sum before r0), and the sum through
        the block's last row.  Padding past ``T`` reads beta = 0, g = 0."""
        o_t = r0 + tl.arange(0, BC)
        b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=o_t < T, other=0.0).to(tl.float32)
        if GATE == 1:
            b_g = reset_floor(tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T,
                                      other=0.0).to(tl.float32))
            b_G = tl.cumsum(b_g, axis=0) + g_off
            g_end = g_off + tl.sum(b_g, axis=0)
        else:
            b_G = tl.zeros([BC], dtype=tl.float32)
            g_end = g_off
        return b_b, b_G, g_end

    @triton.jit
    def _load_tile(base, T, N: tl.constexpr, r0, c0, H: tl.constexpr, BR: tl.constexpr,
                   BN: tl.constexpr):
        """Rows ``[r0, r0 + BR)``, columns ``[c0, c0 + BN)`` of a head's ``[T, N]`` slice
        (token stride ``H * N``), as stored (zero padding)."""
        p = tl.make_block_ptr(base, (T, N), (H * N, 1), (r0, c0), (BR, BN), (1, 0))
        return tl.load(p, boundary_check=(0, 1))

    @triton.jit
    def _key_blocks(base_k, T, K: tl.constexpr, t0, c0, H: tl.constexpr, BC: tl.constexpr,
                    SBK: tl.constexpr):
        """The chunk's four ``[BC, SBK]`` row blocks of keys, columns from ``c0``."""
        return (_load_tile(base_k, T, K, t0, c0, H, BC, SBK),
                _load_tile(base_k, T, K, t0 + BC, c0, H, BC, SBK),
                _load_tile(base_k, T, K, t0 + 2 * BC, c0, H, BC, SBK),
                _load_tile(base_k, T, K, t0 + 3 * BC, c0, H, BC, SBK))

    @triton.jit
    def _store_tile(base, T, N: tl.constexpr, r0, c0, y, H: tl.constexpr, BR: tl.constexpr,
                    BN: tl.constexpr):
        """Store ``y [BR, BN]`` at rows ``[r0, r0 + BR)``, columns from ``c0`` of a head's
        ``[T, N]`` slice (token stride ``H * N``), in the buffer's dtype."""
        p = tl.make_block_ptr(base, (T, N), (H * N, 1), (r0, c0), (BR, BN), (1, 0))
        tl.store(p, y.to(p.dtype.element_ty), boundary_check=(0, 1))

    @triton.jit
    def _store_block_row(base_x, T, r0, y0, y1, y2, y3, H: tl.constexpr, BC: tl.constexpr):
        """Rows ``[r0, r0 + BC)`` of a chunk's ``X`` (``[T, 4 BC]`` slice of
        ``xs [B, T, H, 4 BC]``) from its four ``[BC, BC]`` blocks."""
        _store_tile(base_x, T, 4 * BC, r0, 0, y0, H, BC, BC)
        _store_tile(base_x, T, 4 * BC, r0, BC, y1, H, BC, BC)
        _store_tile(base_x, T, 4 * BC, r0, 2 * BC, y2, H, BC, BC)
        _store_tile(base_x, T, 4 * BC, r0, 3 * BC, y3, H, BC, BC)

    @triton.jit
    def _off_block(kk, bi, Gi, Gj, GATE: tl.constexpr):
        """``A_ij = diag(b_i) (k_i k_j^T * exp(G_i - G_j))`` from ``kk = k_i k_j^T`` for a
        block strictly below the diagonal (every row after every column: the exponent is
        never positive)."""
        if GATE == 1:
            kk = kk * tl.exp(Gi[:, None] - Gj[None, :])
        return kk * bi[:, None]

    @triton.jit
    def _diag_block_t(kk, b, G, BC: tl.constexpr, GATE: tl.constexpr):
        """A diagonal block's ``A_ii`` *transposed*, ``[BC, BC]``: ``at[m, i] = b_i (k_i . k_m)
        exp(G_i - G_m)`` for ``m < i``, else 0.  ``kk = k_i k_i^T`` is symmetric, so the
        transpose costs nothing, and the substitution reads rows of ``A_ii`` as columns of
        ``at`` in the layout its update needs."""
        rows = tl.arange(0, BC)
        upper = rows[:, None] < rows[None, :]
        if GATE == 1:  # masked before exp: the exponent of a kept entry is never positive
            kk = kk * tl.exp(tl.where(upper, G[None, :] - G[:, None], float("-inf")))
        else:
            kk = tl.where(upper, kk, 0.0)
        return kk * b[None, :]

    @triton.jit
    def _unit_lower_inverse4(t0, t1, t2, t3, BC: tl.constexpr):
        """``(I + A_b)^{-1}`` of four strictly lower ``[BC, BC]`` blocks given transposed
        (``t_b = A_b^T``), by forward substitution ``x_i = e_i - sum_{m < i} A_im x_m``
        (rows before i are final when row i is formed; row i of x is still e_i).

        Row i of ``A_b`` is column i of ``t_b``: it comes out of the reduction indexed like
        the rows of x, so a step needs no layout change (no shared-memory round trip).  The
        four chains are independent and interleaved; the loop is not unrolled, so one
        step's rows are live at a time (registers)."""
        rows = tl.arange(0, BC)
        eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        x0, x1, x2, x3 = eye, eye, eye, eye
        for i in range(1, BC):
            col = rows[None, :] == i
            row = rows[:, None] == i
            a0 = tl.sum(tl.where(col, t0, 0.0), axis=1)
            a1 = tl.sum(tl.where(col, t1, 0.0), axis=1)
            a2 = tl.sum(tl.where(col, t2, 0.0), axis=1)
            a3 = tl.sum(tl.where(col, t3, 0.0), axis=1)
            x0 -= tl.where(row, tl.sum(a0[:, None] * x0, axis=0)[None, :], 0.0)
            x1 -= tl.where(row, tl.sum(a1[:, None] * x1, axis=0)[None, :], 0.0)
            x2 -= tl.where(row, tl.sum(a2[:, None] * x2, axis=0)[None, :], 0.0)
            x3 -= tl.where(row, tl.sum(a3[:, None] * x3, axis=0)[None, :], 0.0)
        return x0, x1, x2, x3

    @triton.jit
    def _wy_solve(k, g, beta, xs, bos, t0, T, i_h, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, SBK: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
        """One chunk's ``X = (I + A)^{-1}`` into ``xs`` (rows of the chunk at their tokens,
        all 64 columns: the blocks above the diagonal are written as zeros).

        Blocked in four 16-row blocks: ``A``'s ten lower blocks from k k^T sums over K tiles
        (16-bit keys: 16-bit operands, exact products); the diagonal blocks of X by forward
        substitution (stable for aligned keys, where a product of powers of A cancels
        catastrophically); the blocks below by two levels of the 2 x 2 block inverse
        ``[[X_00, 0], [-X_11 A_10 X_00, X_11]]`` (pairs of 16-row blocks, then the two
        halves), i.e. block substitution ``X_ij = -X_ii sum_{j <= m < i} A_im X_mj`` with the
        sums grouped for a shorter dependency chain, fp32 operands at ``PREC``.  Stored in
        xs's dtype."""
        BC: tl.constexpr = BT // 4
        zero = tl.full((), 0.0, tl.float32)
        b0, G0, s0 = _wy_gates(g, beta, bos, t0, T, i_h, zero, H, BC, GATE)
        b1, G1, s1 = _wy_gates(g, beta, bos, t0 + BC, T, i_h, s0, H, BC, GATE)
        b2, G2, s2 = _wy_gates(g, beta, bos, t0 + 2 * BC, T, i_h, s1, H, BC, GATE)
        b3, G3, s3 = _wy_gates(g, beta, bos, t0 + 3 * BC, T, i_h, s2, H, BC, GATE)
        base_k = k + (bos * H + i_h) * K
        # the diagonal blocks first, the blocks below after the substitution (a second pass
        # over k, from L2): fewer accumulators live at once (registers)
        kk00 = tl.zeros([BC, BC], dtype=tl.float32)
        kk11 = tl.zeros([BC, BC], dtype=tl.float32)
        kk22 = tl.zeros([BC, BC], dtype=tl.float32)
        kk33 = tl.zeros([BC, BC], dtype=tl.float32)
        for c0 in range(0, K, SBK):
            k0, k1, k2, k3 = _key_blocks(base_k, T, K, t0, c0, H, BC, SBK)
            kk00 = tl.dot(k0, tl.trans(k0), kk00, input_precision=PREC)
            kk11 = tl.dot(k1, tl.trans(k1), kk11, input_precision=PREC)
            kk22 = tl.dot(k2, tl.trans(k2), kk22, input_precision=PREC)
            kk33 = tl.dot(k3, tl.trans(k3), kk33, input_precision=PREC)
        x00, x11, x22, x33 = _unit_lower_inverse4(
            _diag_block_t(kk00, b0, G0, BC, GATE), _diag_block_t(kk11, b1, G1, BC, GATE),
            _diag_block_t(kk22, b2, G2, BC, GATE), _diag_block_t(kk33, b3, G3, BC, GATE), BC)
        kk10 = tl.zeros([BC, BC], dtype=tl.float32)
        kk20 = tl.zeros([BC, BC], dtype=tl.float32)
        kk21 = tl.zeros([BC, BC], dtype=tl.float32)
        kk30 = tl.zeros([BC, BC], dtype=tl.float32)
        kk31 = tl.zeros([BC, BC], dtype=tl.float32)
        kk32 = tl.zeros([BC, BC], dtype=tl.float32)
        for c0 in range(0, K, SBK):
            k0, k1, k2, k3 = _key_blocks(base_k, T, K, t0, c0, H, BC, SBK)
            kk10 = tl.dot(k1, tl.trans(k0), kk10, input_precision=PREC)
            kk20 = tl.dot(k2, tl.trans(k0), kk20, input_precision=PREC)
            kk21 = tl.dot(k2, tl.trans(k1), kk21, input_precision=PREC)
            kk30 = tl.dot(k3, tl.trans(k0), kk30, input_precision=PREC)
            kk31 = tl.dot(k3, tl.trans(k1), kk31, input_precision=PREC)
            kk32 = tl.dot(k3, tl.trans(k2), kk32, input_precision=PREC)
        a10 = _off_block(kk10, b1, G1, G0, GATE)
        a20 = _off_block(kk20, b2, G2, G0, GATE)
        a21 = _off_block(kk21, b2, G2, G1, GATE)
        a30 = _off_block(kk30, b3, G3, G0, GATE)
        a31 = _off_block(kk31, b3, G3, G1, GATE)
        a32 = _off_block(kk32, b3, G3, G2, GATE)
        # 32-row halves: [[x00, 0], [x10, x11]] and [[x22, 0], [x32, x33]]
        x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PREC), input_precision=PREC)
        x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=PREC), input_precision=PREC)
        # the lower-left half: -X_hi (A_lo X_lo), with A_lo = [[a20, a21], [a30, a31]]
        p00 = tl.dot(a21, x10, tl.dot(a20, x00, input_precision=PREC), input_precision=PREC)
        p01 = tl.dot(a21, x11, input_precision=PREC)
        p10 = tl.dot(a31, x10, tl.dot(a30, x00, input_precision=PREC), input_precision=PREC)
        p11 = tl.dot(a31, x11, input_precision=PREC)
        x20 = -tl.dot(x22, p00, input_precision=PREC)
        x21 = -tl.dot(x22, p01, input_precision=PREC)
        x30 = -tl.dot(x33, p10, tl.dot(x32, p00, input_precision=PREC), input_precision=PREC)
        x31 = -tl.dot(x33, p11, tl.dot(x32, p01, input_precision=PREC), input_precision=PREC)
        base_x = xs + (bos * H + i_h) * BT
        nil = tl.zeros([BC, BC], dtype=tl.float32)  # above the diagonal
        _store_block_row(base_x, T, t0, x00, nil, nil, nil, H, BC)
        _store_block_row(base_x, T, t0 + BC, x10, x11, nil, nil, H, BC)
        _store_block_row(base_x, T, t0 + 2 * BC, x20, x21, x22, nil, H, BC)
        _store_block_row(base_x, T, t0 + 3 * BC, x30, x31, x32, x33, H, BC)

    @triton.jit
    def _wy_apply(k, v, g, beta, w, u, xs, bos, t0, T, i_h, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  GATE: tl.constexpr, PREC: tl.constexpr, STORE_A: tl.constexpr, q, a):
        """One chunk's ``W = X diag(b exp(G)) K`` and ``U = X diag(b) V`` from its
        ``X [BT, BT]`` in ``xs``: one ``[BT, BT] x [BT, N]`` product per tile, operands in
        X's dtype (a bf16 X: bf16 operands, fp32 accumulation).  STORE_A: also the output
        walk's in-chunk attention ``A_ij = q_i . k_j exp(G_i - G_j)`` (``j <= i``, unscaled)
        into ``a [B, T, H, BT]`` in q's dtype, from the k tiles this loop reads anyway, so the
        walker does not form it again in each of its V tiles."""
        zero = tl.full((), 0.0, tl.float32)
        b_b, b_G, _ = _wy_gates(g, beta, bos, t0, T, i_h, zero, H, BT, GATE)
        b_x = _load_tile(xs + (bos * H + i_h) * BT, T, BT, t0, 0, H, BT, BT)
        XT = b_x.dtype
        b_bk = b_b * tl.exp(b_G) if GATE == 1 else b_b
        base_k = k + (bos * H + i_h) * K
        base_w = w + (bos * H + i_h) * K
        if STORE_A:
            b_qk = tl.zeros([BT, BT], dtype=tl.float32)
        for c0 in range(0, K, BK):
            b_k = _load_tile(base_k, T, K, t0, c0, H, BT, BK)
            b_r = (b_k.to(tl.float32) * b_bk[:, None]).to(XT)
            _store_tile(base_w, T, K, t0, c0, tl.dot(b_x, b_r, input_precision=PREC), H, BT, BK)
            if STORE_A:
                b_q = _load_tile(q + (bos * H + i_h) * K, T, K, t0, c0, H, BT, BK)
                b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        if STORE_A:
            rows = tl.arange(0, BT)
            causal = rows[:, None] >= rows[None, :]
            if GATE == 1:  # masked before the exponential: never positive
                b_qk = b_qk * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
            else:
                b_qk = tl.where(causal, b_qk, 0.0)
            _store_tile(a + (bos * H + i_h) * BT, T, BT, t0, 0, b_qk, H, BT, BT)
        base_v = v + (bos * H + i_h) * V
        base_u = u + (bos * H + i_h) * V
        for c0 in range(0, V, BV):
            b_r = (_load_tile(base_v, T, V, t0, c0, H, BT, BV).to(tl.float32)
                   * b_b[:, None]).to(XT)
            _store_tile(base_u, T, V, t0, c0, tl.dot(b_x, b_r, input_precision=PREC), H, BT, BV)

    @triton.jit
    def _wy_kernel(k, v, g, beta, w, u, xs, T, C0, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   SBK: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
                   SOLVE: tl.constexpr, APPLY: tl.constexpr, STORE_A: tl.constexpr = False,
                   q=None, a=None):
        """grid ``(n, B * H)``, one chunk of ``BT = 64`` tokens per program, the chunks
        ``[C0, C0 + n)`` (all of them: ``C0 = 0``, ``n = NT``); k, w
        [B, T, H, K]; v, u [B, T, H, V]; g, beta [B, T, H]; xs [B, T, H, BT] (fp32 or bf16):
        the chunk's inverse ``X``, row ``i`` at its token ``i``.

        SOLVE: ``X = (I + A)^{-1}`` into xs (:func:`_wy_solve`); APPLY: W and U from xs
        (:func:`_wy_apply`; STORE_A: with the output walk's attention from q [B, T, H, K]
        into a [B, T, H, BT]).  Both in one launch: the program reads back its own X after a
        barrier (a CTA's global writes are visible to its threads after ``bar.sync``).
        """
        i_t, i_bh = C0 + tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets pass 2**31 at long T
        bos = i_b * T
        t0 = i_t * BT
        if SOLVE:
            _wy_solve(k, g, beta, xs, bos, t0, T, i_h, H, K, BT, SBK, GATE, PREC)
        if SOLVE and APPLY:
            tl.debug_barrier()
        if APPLY:
            _wy_apply(k, v, g, beta, w, u, xs, bos, t0, T, i_h, H, K, V, BT, BK, BV, GATE,
                      PREC, STORE_A, q, a)


def wy_x_dtype(dtype: torch.dtype, store_x: bool = False, cfg: dict = None) -> torch.dtype:
    """The dtype of the WY inverse ``X`` for inputs of ``dtype`` (see ``WY_CONFIG``)."""
    cfg = WY_CONFIG if cfg is None else cfg
    if cfg["x_dtype"] not in ("input", "fp32"):
        raise ValueError("WY_CONFIG['x_dtype']: expected 'input' or 'fp32', got "
                         f"{cfg['x_dtype']!r}")
    if store_x or dtype != torch.bfloat16 or cfg["x_dtype"] == "fp32":
        return torch.float32
    return dtype


def wy_launches(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype, gated: bool,
                prec: str, cfg: dict = None, store_a: bool = False,
                n_chunks: Optional[int] = None) -> list:
    """The launches of :func:`wy` for inputs of ``dtype``,
    ``[(grid, constexprs, num_warps, num_stages)]``, every one with the runtime arguments
    ``(k, v, g, beta, w, u, xs, T, C0)`` (C0: the first chunk) and, where ``STORE_A``
    (``store_a``: the launch that forms W and U also forms the output walk's attention),
    ``(q, a)`` after them (as :class:`~.ir.Launch` records: :func:`wy_launch_records`);
    ``n_chunks``: the chunks each launch covers (default all)."""
    cfg = WY_CONFIG if cfg is None else cfg
    grid = (-(-T // WY_BT) if n_chunks is None else n_chunks, B * H, 1)
    # solve_BK counts 16-bit elements: fp32 keys take half as many (the same bytes, registers)
    wide = torch.empty((), dtype=dtype).element_size() > 2
    sbk = cfg["solve_BK"] // 2 if wide else cfg["solve_BK"]
    const = dict(H=H, K=K, V=V, BT=WY_BT, BK=min(cfg["BK"], next_pow2(K)),
                 BV=min(cfg["BV"], next_pow2(V)), SBK=max(16, min(sbk, next_pow2(K))),
                 GATE=1 if gated else 0, PREC=prec)
    # q and a are pointers where STORE_A, else None constexprs
    plain = dict(STORE_A=False, q=None, a=None)
    apply = dict(STORE_A=True) if store_a else plain
    if cfg["fused"]:
        return [(grid, dict(const, SOLVE=True, APPLY=True, **apply), cfg["num_warps"],
                 cfg["num_stages"])]
    return [(grid, dict(const, SOLVE=True, APPLY=False, **plain), cfg["solve_warps"],
             cfg["solve_stages"]),
            (grid, dict(const, SOLVE=False, APPLY=True, **apply), cfg["num_warps"],
             cfg["num_stages"])]


def wy_launch_records(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype,
                      gated: bool, prec: str, cfg: dict = None, store_a: bool = False,
                      chunks: Optional[Tuple[int, int]] = None) -> List[Launch]:
    """:func:`wy_launches` as launch records on buffers ``k, v, g`` (``beta`` when not
    ``gated``), ``beta``, ``w, u, xs`` and, where ``STORE_A``, ``q, a``: what :func:`wy`,
    :func:`forward_program` and ``delta_backward.backward_program`` launch.  ``chunks``:
    ``(first, count)``, the launches for those chunks alone (default all)."""
    c0, n = (0, None) if chunks is None else chunks
    args = (("k", "buf", "k"), ("v", "buf", "v"), ("g", "buf", "g" if gated else "beta"),
            ("beta", "buf", "beta"), ("w", "buf", "w"), ("u", "buf", "u"),
            ("xs", "buf", "xs"), ("T", "i32", T), ("C0", "i32", c0))
    a_args = (("q", "buf", "q"), ("a", "buf", "a"))  # the launch forming the walk's attention
    return [Launch("wy", grid, args + (a_args if const["STORE_A"] else ()),
                   tuple(const.items()), nw, ns)
            for grid, const, nw, ns in wy_launches(B, T, H, K, V, dtype=dtype, gated=gated,
                                                   prec=prec, cfg=cfg, store_a=store_a,
                                                   n_chunks=n)]


@functools.lru_cache(maxsize=64)
def _wy_records(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, gated: bool,
                prec: str, store_a: bool, config: tuple) -> tuple:
    """:func:`wy_launch_records` for :func:`wy`, kept per shape and ``WY_CONFIG``'s items
    (an eager call built them every time: about 5 us of Python).  Read only."""
    return tuple(wy_launch_records(B, T, H, K, V, dtype=dtype, gated=gated, prec=prec,
                                   cfg=dict(config), store_a=store_a))


def wy_kernel_specs(K: int = 128, V: int = 128, *, H: int = 32, dtype=torch.bfloat16,
                    gated: bool = True, prec: str = None, store_x: bool = False,
                    store_a: bool = False) -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of every launch of :func:`wy` for
    inputs of ``dtype`` (fp32 gates; ``store_x``: the backward's fp32 X), for AOT compilation
    and the resource report.  ``prec``: the dots' precision, by default what the forward
    and backward pass (TF32 for 16-bit inputs, 3xTF32 for fp32)."""
    if prec is None:
        prec = "tf32x3" if dtype == torch.float32 else "tf32"
    io = "*" + tl_type(dtype)
    xs = "*" + tl_type(wy_x_dtype(dtype, store_x))
    sig = (("k", io), ("v", io), ("g", "*fp32"), ("beta", "*fp32"), ("w", io), ("u", io),
           ("xs", xs), ("T", "i32"), ("C0", "i32"))
    return [KernelSpec(f"{__name__}:_wy_kernel",
                       sig + ((("q", io), ("a", io)) if const["STORE_A"] else ()),
                       tuple(const.items()), nw, ns)
            for _, const, nw, ns in wy_launches(1, 256, H, K, V, dtype=dtype, gated=gated,
                                                prec=prec, store_a=store_a)]


def wy(k, v, g, beta, *, BT: int, prec: str, dtype, store_x: bool = False, q=None):
    """``(W [B, T, H, K], U [B, T, H, V])`` in ``dtype``; chunks of ``BT = 64`` tokens; k, v
    ``[B, T, H, K|V]``, g (log decays, or ``None``) and beta ``[B, T, H]``.  The per-chunk
    inverse ``X [B, T, H, BT]`` passes through a buffer (:func:`wy_x_dtype`); ``store_x``
    keeps it in fp32 and returns it as a third result (zero above each chunk's diagonal).
    ``q [B, T, H, K]``: also the output walk's in-chunk attention ``A [B, T, H, BT]`` in q's
    dtype (unscaled, zero above the diagonal) as a third result (not with ``store_x``)."""
    if BT != WY_BT:
        raise ValueError(f"wy: the blocked inverse works on chunks of 64 tokens, got BT={BT}")
    if store_x and q is not None:
        raise ValueError("wy: store_x (the backward's X) and q (the forward's attention) "
                         "are not asked for together")
    B, T, H, K = k.shape
    V = v.shape[-1]
    w = torch.empty(B, T, H, K, dtype=dtype, device=k.device)
    u = torch.empty(B, T, H, V, dtype=dtype, device=k.device)
    xs = torch.empty(B, T, H, BT, dtype=wy_x_dtype(k.dtype, store_x), device=k.device)
    a = None if q is None else torch.empty(B, T, H, BT, dtype=q.dtype, device=k.device)
    tensors = {"k": k, "v": v, "beta": beta, "w": w, "u": u, "xs": xs}
    tensors.update((n, t) for n, t in (("g", g), ("q", q), ("a", a)) if t is not None)
    for ln in _wy_records(B, T, H, K, V, k.dtype, g is not None, prec, q is not None,
                          tuple(WY_CONFIG.items())):
        run_launch(ln, tensors, _wy_kernel)
    if store_x:
        return w, u, xs
    return (w, u) if q is None else (w, u, a)


def forward_program(*, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
                    gated: bool, has_h0: bool, store_o: bool = True, scale: float, prec: str,
                    execution: Optional[str] = None, tiles: Optional[dict] = None,
                    gate_dtype: torch.dtype = torch.float32,
                    beta_dtype: Optional[torch.dtype] = None,
                    maps: Optional[Dict[str, Any]] = None,
                    summary: str = NO_SUMMARY) -> Program:
    """The launches of :meth:`DeltaRuleWork.finish` as a :class:`~.ir.Program`:
    :func:`.walker_launches.matrix_buffers`, ``g [B, T, H]`` (``gate_dtype``, ``gated``)
    and ``beta [B, T, H]`` (``beta_dtype``, default ``gate_dtype``); the WY inverses X
    (workspace ``xs``), the gates' chunk sums (``gated``), the launch forming W and U
    (workspaces ``w, u``) and the walk's in-chunk attention ``a``, then one fused walk.
    Only the fused schedule exists, and no fused prologues.  ``tiles`` overrides entries
    of :func:`fused_config`.

    ``summary``: what a sequence-parallel rank keeps for the state pass, from walks
    launched before the output walk (always the last launch, so the pass goes before it):
    the W and U launch goes in :func:`summary_pieces` and each piece's summary walks follow
    it on the side stream (``ir.SIDE``).  ``"state"``: the shard's state from a zero start
    in workspace ``delta [B, H, K, V]`` fp32 (rank 0 without an initial state, whose
    transition nobody needs); ``"folded"``: also its dense transition ``M [B, H, K, K]``
    fp32 (a walk with no values from the identity).  Both walks use the forward's operands
    and WY factors (the default ``FORGE_DIST_DENSE_SUMMARY=input`` of
    :class:`DeltaRuleWork`)."""
    if execution not in (None, "auto", scheduler.FUSED):
        raise ValueError(f"execution={execution!r}: gated_delta_rule has only the fused "
                         "kernels")
    if maps:
        raise ValueError("maps: the gated_delta_rule kernels take no fused prologues")
    if summary not in DENSE_SUMMARIES:
        raise ValueError(f"summary: the delta rule keeps one of {DENSE_SUMMARIES}, "
                         f"got {summary!r}")
    if not store_o:
        raise ValueError("gated_delta_rule: a summary without outputs is not a program "
                         "here; pass summary= with the outputs")
    cfg = dict(fused_config(K, V, dtype), **(tiles or {}))
    BT = cfg["BT"]
    if BT != WY_BT:
        raise ValueError(f"gated_delta_rule: the WY factors work on chunks of {WY_BT} "
                         f"tokens, got BT={BT}")
    bufs = matrix_buffers(B=B, T=T, H=H, K=K, V=V, dtype=dtype, store_o=True, has_h0=has_h0)
    if gated:
        bufs["g"] = Buffer((B, T, H), gate_dtype, "input")
    bufs["beta"] = Buffer((B, T, H), beta_dtype or gate_dtype, "input")
    bufs["w"] = Buffer((B, T, H, K), dtype, "workspace")
    bufs["u"] = Buffer((B, T, H, V), dtype, "workspace")
    bufs["xs"] = Buffer((B, T, H, BT), wy_x_dtype(dtype), "workspace")
    bufs["a"] = Buffer((B, T, H, BT), dtype, "workspace")
    low = dtype in (torch.float16, torch.bfloat16)
    wy_prec = "tf32" if low and prec != "ieee" else prec
    wy_kw = dict(dtype=dtype, gated=gated, prec=wy_prec, store_a=True)
    pieces = [None] if summary == NO_SUMMARY else summary_pieces(T)
    # the inverses X of the whole shard (no launch of its own in the fused WY config)
    launches = wy_launch_records(B, T, H, K, V, **wy_kw)[:-1]
    # the gate sum stays a launch of its own for the delta rule (see _finish_fwd)
    if gated:
        launches.append(gate_cumsum(bufs, B=B, T=T, H=H, BT=BT))
    stream = SIDE if len(pieces) > 1 else MAIN
    for chunks in pieces:  # W and U (and A) per piece, each piece's summary walks after it
        launches.append(wy_launch_records(B, T, H, K, V, chunks=chunks, **wy_kw)[-1])
        if chunks is not None:
            walks = summary_launches(bufs, B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                                     gated=gated, transition=summary == FOLDED, prec=prec,
                                     tiles=tiles, chunks=chunks)
            launches += [dataclasses.replace(ln, stream=stream) for ln in walks]
    launches += walk_launches(bufs, h0="h0" if has_h0 else None, o="o", ht="ht", V=V,
                              a="a", q="q", k="k", v="u", g="g_cum" if gated else None,
                              w="w", B=B, T=T, H=H, K=K, gate=1 if gated else 0,
                              scale=scale, cfg=cfg, prec=prec)
    return Program(launches, bufs, scheduler.FUSED, [])


# The summary walks' tiles (no outputs: the state's V columns, or K for the transition,
# over the shard's chunks), as a sequence-parallel rank before the last runs them between
# the WY factors and the state pass: every microsecond of them is on the chain's critical
# path.  Overridable for tuning with FORGE_DIST_DENSE_SUMMARY_TILES ("BV=16,num_warps=2").
# Measured on 2 x H100 (the whole sequence-parallel forward, B=1, H=32, K=V=128, 32K tokens
# per GPU, docs/performance.md): the fused walk's BV=32 with 4 warps 2.29 ms; BV=16 with
# 2 warps 3.06, with 4 warps 2.33; BV=64 2.40.
SUMMARY_CONFIG: Dict[str, int] = {}


def summary_config(K: int, V: int, dtype: torch.dtype) -> dict:
    """The tile config of the delta rule's summary walks: :func:`fused_config` with
    ``SUMMARY_CONFIG`` and ``FORGE_DIST_DENSE_SUMMARY_TILES`` (``key=value`` pairs of
    ``BV``, ``num_warps``, ``num_stages``) over it."""
    return {**fused_config(K, V, dtype), **SUMMARY_CONFIG,
            **env_tiles("FORGE_DIST_DENSE_SUMMARY_TILES")}


def summary_launches(bufs: Dict[str, Buffer], *, B: int, T: int, H: int, K: int, V: int,
                     dtype: torch.dtype, gated: bool, transition: bool, prec: str,
                     tiles: Optional[dict] = None,
                     chunks: Optional[Tuple[int, int]] = None) -> List[Launch]:
    """The launches of a shard's summary from the WY factors (buffers ``k, u, w`` and,
    ``gated``, the gates' chunk sums ``g_cum``): its state from a zero start into workspace
    ``delta [B, H, K, V]`` and, with ``transition``, its dense transition into ``M [B, H,
    K, K]`` (the same walk with no values from the identity, ``H0_EYE``).  One walk over
    the shard each: cutting it into segments walked in parallel and folded measured slower
    (docs/performance.md).  ``chunks``: ``(first, count)`` of ``WY_BT``-token chunks, the
    walks over that piece alone, continuing ``delta`` and ``M`` from the piece before it
    (from zero and the identity at chunk 0).  What :func:`forward_program` and
    :meth:`DeltaRuleWork._summary_fwd` launch."""
    cfg = dict(summary_config(K, V, dtype), **(tiles or {}))
    c0, n = (0, -(-T // WY_BT)) if chunks is None else chunks
    first = c0 == 0
    walk = dict(q=None, k="k", v="u", g="g_cum" if gated else None, w="w", o=None,
                gt=None, B=B, T=T, H=H, K=K, gate=1 if gated else 0, scale=1.0, cfg=cfg,
                prec=prec, seg=n * WY_BT, n=1, t0=c0 * WY_BT)
    bufs["delta"] = Buffer((B, H, K, V), torch.float32, "workspace")
    launches = [walk_launch(h0=None if first else "delta", ht="delta", V=V, **walk)]
    if transition:
        bufs["M"] = Buffer((B, H, K, K), torch.float32, "workspace")
        launches.append(walk_launch(h0=None if first else "M", ht="M", V=K, h0_eye=first,
                                    **dict(walk, v=None)))
    return launches


# A rank's summary walks follow its WY factors in pieces of the shard: after the inverses X
# of the whole shard, the launch forming W and U runs once per piece, and each piece's walks
# run on a second stream behind it (ir.SIDE), so that the summary, on the chain's critical
# path, ends about one piece's walk after the WY factors instead of a whole walk after them
# (docs/design.md section 3).  Measured on 2 x H200, forward, B=1, H=32, K=V=128, 32K tokens
# per GPU (docs/performance.md): 4 pieces 1.22x the shard, one walk after the WY factors
# 1.35x in the same run; 8 pieces 1.25x; X cut in pieces too 1.26-1.32x.  Each piece costs
# host time (two launches and a fork), so by default a piece spans at least
# PIECE_MIN_CHUNKS chunks.  FORGE_DIST_DENSE_SUMMARY_PIECES sets the count (at most one piece
# per chunk); 1 walks after the WY factors.
SUMMARY_PIECES = 4
PIECE_MIN_CHUNKS = 128


def summary_pieces(T: int) -> List[Tuple[int, int]]:
    """``[(first chunk, chunks)]`` of a summary's pieces over a shard of ``T`` tokens:
    near-equal runs of ``WY_BT``-token chunks, ``SUMMARY_PIECES`` of at least
    ``PIECE_MIN_CHUNKS`` (one piece below that), or ``FORGE_DIST_DENSE_SUMMARY_PIECES`` (a
    tuning switch read when a program is built: a cached plan keeps its pieces)."""
    n_chunks = -(-T // WY_BT)
    wanted = env_positive_int("FORGE_DIST_DENSE_SUMMARY_PIECES")
    if wanted is None:
        wanted = max(1, min(SUMMARY_PIECES, n_chunks // PIECE_MIN_CHUNKS))
    count = min(wanted, n_chunks)
    bounds = [n_chunks * i // count for i in range(count + 1)]
    return [(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


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

    def _wy_factors(self, q, k, v, g, beta, cfg):
        """``(W, U, A)`` in the input dtype, ``A`` the output walk's in-chunk attention
        (formed with W: the outputs follow on the same work, also after a summary):
        bf16/fp16 inputs use TF32 for the WY products, fp32 inputs stay fp32 (3xTF32)."""
        if self._wy is None:
            low = k.dtype in (torch.float16, torch.bfloat16)
            prec = "tf32" if low and dot_precision(k.dtype) != "ieee" else dot_precision(k.dtype)
            self._wy = wy(k, v, g, beta, BT=cfg["BT"], prec=prec, dtype=k.dtype, q=q)
        return self._wy

    def release(self) -> None:
        super().release()
        self._wy = None

    def prepare(self) -> None:
        """The WY factors before the incoming state arrives (they need no state)."""
        if self._wy is None:
            with torch.no_grad():
                q, k, v, g, beta = (ensure(None if t is None else t.detach())
                                    for t in self.tensors)
                self._wy_factors(q, k, v, g, beta,
                                 fused_config(k.shape[-1], v.shape[-1], k.dtype))

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1], k.dtype)
        self.execution, self.execution_reason = "fused", "decoupled not built for this pattern"
        w, u, a = self._wy_factors(q, k, v, g, beta, cfg)
        # the gates' chunk sums are a launch of their own here at every length: summed in this
        # fused walk (its few programs walk every chunk) the forward took 0.85 ms at 16K
        # instead of 0.78 (H200, results/single_device_NVIDIA-H200_2026-11-25_s24-short.json
        # against ..._2026-11-24_s22-fwd.json)
        return walk(k, u, q=q, g=g, gate=0 if g is None else 1, w=w, h0=S_in, scale=self.scale,
                    out_dtype=self.out_dtype, cfg=cfg, prec=dot_precision(k.dtype), a=a,
                    raw_gates=False)

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        exact = k.dtype == torch.float32 or summary_precision() == "fp32"
        cfg = summary_config(k.shape[-1], v.shape[-1], torch.float32 if exact else k.dtype)
        if exact:
            prec = dot_precision(torch.float32)
            k, v = k.to(torch.float32), v.to(torch.float32)
            w, u = wy(k, v, g, beta, BT=cfg["BT"], prec=prec, dtype=torch.float32)
        else:  # the forward's operands: the WY factors are shared with finish()
            prec = dot_precision(k.dtype)
            w, u, _ = self._wy_factors(q, k, v, g, beta, cfg)
        gate = 0 if g is None else 1
        B, T, H, K = k.shape
        bufs: Dict[str, Buffer] = {}
        # k is in the walks' dtype here (fp32 when exact): the same tiles as cfg's
        launches = summary_launches(bufs, B=B, T=T, H=H, K=K, V=v.shape[-1], dtype=k.dtype,
                                    gated=bool(gate), transition=need_M, prec=prec)
        tensors = {n: torch.empty(b.shape, dtype=b.dtype, device=k.device)
                   for n, b in bufs.items()}
        tensors.update(k=k, u=u, w=w)
        if gate:
            tensors["g_cum"] = walker_gates(g, gate, cfg["BT"])  # the walks share it
        for ln in launches:
            run_launch(ln, tensors)
        return tensors["delta"], tensors.get("M")

    # Triton backward (kernels/delta_backward.py) -----------------------------------------
    def _finish_bwd(self, S_in, tensors, do, dht):
        from .delta_backward import delta_rule_backward  # lazy: it imports this module

        q, k, v, g, beta = (ensure(t) for t in tensors)
        dq, dk, dv, dg, dbeta, dS = delta_rule_backward(q, k, v, g, beta, S_in, do, dht,
                                                        self.scale)
        return [dS, dq, dk, dv, grad_like(dg, tensors[3]), grad_like(dbeta, tensors[4])]

    def _summary_bwd(self, tensors, ddelta, dM):
        """``delta`` is the end state from a zero start and ``M`` the end state of the same
        walk from ``I`` with no values; the state's columns are independent, so both run as
        one backward over the values ``[v | 0]`` from ``[0 | I]``."""
        from .delta_backward import delta_rule_backward  # lazy: it imports this module

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

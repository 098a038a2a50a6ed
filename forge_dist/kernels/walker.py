"""The fused chunk walker every matrix-state pattern shares: its kernels and launches.

The walker is one Triton kernel for the three matrix-state patterns (scalar decay, vector
decay, delta rule).  One program owns one ``(batch, head, V tile)``: it keeps the fp32 state
tile ``S [BK, BV]`` on chip and walks the chunks of ``BT`` tokens in order, per chunk::

    v'   = v - W S                         (delta rule only: WY correction, W from delta.py)
    o    = scale * ((q * exp(G)) S + A v')  A_ij = q_i.(k_j * exp(G_i - G_j)), j <= i
    S    = exp(G_C) * S + (k * exp(G_C - G))^T v'

with ``G`` the in-chunk cumulative log decay (a scalar per token, or a K-vector per token).
Every exponent is a non-positive difference: the ``i < j`` entries are masked *before* the
exponential, so gates of -20 per token cannot overflow.  The one exception is bounded: a
scalar-gate output walk whose segment's chunks each decay by at most ``FACTOR_SPAN`` (60; 8
for fp16 operands) in log computes ``exp(G_i - G_j)`` as ``exp(G_i - G_C) * exp(G_C - G_j)``,
exponents within that span (``_walk_chunks``, ``FACTORED``); steeper segments take the
masked form.  A per-channel decay arrives with
its in-chunk factors already applied and ``A`` precomputed (:mod:`.vector`), so the walker
only decays the state by ``exp(G_C)``.  With ``STORE_O=False`` the same kernel is the
summary kernel (final state from a zero or given start, no outputs).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, interpreting, next_pow2, tl, triton
from .ir import Buffer, run_launch
from .tiles import mapped_tile, reset_floor, scalar_gate_chunk
from .walker_launches import (gate_cumsum_launch, segment_length, segment_scan_launch,
                              walk_launch, walk_launches)


if HAVE_TRITON:
    # Largest in-chunk log decay for which the scalar-gate walk factors its in-chunk decay
    # (``FACTORED``): the values scaled by exp(G_C - G) (down to exp(-span)) must stay
    # normal numbers in the operand dtype, since the factor exp(G - G_C) brings them back.
    # exp(-60) ~ 1e-26 is normal in fp32 and bf16 (down to 1e-38); fp16's normals end at
    # 6e-5 ~ exp(-9.7), so 16-bit-half inputs factor only chunks within 8.
    FACTOR_SPAN = tl.constexpr(60.0)
    FACTOR_SPAN_FP16 = tl.constexpr(8.0)

    @triton.jit
    def scalar_gate_cum(gc, i_bh, t0, T, BT: tl.constexpr):
        """``G [BT]`` and the chunk total ``G_C`` of the chunk at ``t0`` from the chunk-local
        cumulative log decays ``gc [B, H, T]`` fp32 of :func:`chunk_gate_cumsum` (one
        contiguous fp32 load per chunk, which Triton pipelines; ``[B, T, H]`` 16-bit gates
        read in the walk were 2-byte gathers it does not, and every chunk waited on them)."""
        base = gc + i_bh.to(tl.int64) * T
        o_g = t0 + tl.arange(0, BT)
        b_G = tl.load(base + o_g, mask=o_g < T, other=0.0)
        return b_G, tl.load(base + tl.minimum(t0 + BT, T) - 1)

    @triton.jit
    def _gate_cumsum_kernel(g, gc, T, H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                            G_MAP: tl.constexpr = None):
        """Chunk-local cumulative sums of scalar log decays; grid ``(cdiv(T, BT), B)``.
        g [B, T, H] (any float dtype) -> gc [B, H, T] fp32, summed within each BT-token chunk.
        G_MAP: a fused prologue applied to g first (in fp32; padding stays 0)."""
        i_t, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
        o_t = i_t * BT + tl.arange(0, BT)
        o_h = tl.arange(0, BH)
        m = (o_t < T)[:, None] & (o_h < H)[None, :]
        b_g = tl.load(g + (i_b * T + o_t)[:, None] * H + o_h[None, :], mask=m, other=0.0)
        b_g = b_g.to(tl.float32)
        if G_MAP is not None:
            b_g = tl.where(m, G_MAP(b_g), 0.0)
        b_G = tl.cumsum(reset_floor(b_g), axis=0)
        tl.store(gc + (i_b * H + o_h[None, :]) * T + o_t[:, None], b_G, mask=m)

    @triton.jit
    def _chunk_decays_within(g, i_b, i_h, i_bh, t_lo, t_hi, T, H: tl.constexpr,
                             BT: tl.constexpr, G_RAW: tl.constexpr, SPAN: tl.constexpr):
        """Whether every chunk of ``[t_lo, t_hi)`` decays by at most ``SPAN`` in log
        (its gates sum to ``>= -SPAN``): then :func:`_walk_chunks` may factor the
        in-chunk decay (``FACTORED``).  ``g``: per-token gates ``[B, T, H]`` (G_RAW) or the
        chunk-local cumulative sums ``[B, H, T]`` (a chunk's total at its last token)."""
        NC: tl.constexpr = 16  # chunks per step
        o_c = tl.arange(0, NC)
        lowest = tl.full([NC], 0.0, dtype=tl.float32)
        for c0 in range(t_lo, t_hi, NC * BT):
            if G_RAW:
                o_t = c0 + o_c[:, None] * BT + tl.arange(0, BT)[None, :]
                b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=(o_t < t_hi), other=0.0)
                lowest = tl.minimum(lowest, tl.sum(reset_floor(b_g.to(tl.float32)), axis=1))
            else:
                o_end = tl.minimum(c0 + (o_c + 1) * BT, t_hi) - 1
                b_c = tl.load(g + i_bh.to(tl.int64) * T + o_end,
                              mask=c0 + o_c * BT < t_hi, other=0.0)
                lowest = tl.minimum(lowest, b_c)
        return tl.min(lowest, axis=0) >= -SPAN

    @triton.jit
    def _walk_chunks(q, k, v, g, w, o, a, hc, vn, b_S, i_b, i_h, i_bh, i_v, t_lo, t_hi, T,
                     scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     GATE: tl.constexpr, HAS_V: tl.constexpr, HAS_W: tl.constexpr,
                     STORE_O: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr,
                     STORE_CHUNKS: tl.constexpr, Q_MAP: tl.constexpr, K_MAP: tl.constexpr,
                     V_MAP: tl.constexpr, G_RAW: tl.constexpr, FACTORED: tl.constexpr):
        """The chunk steps of one program over the tokens ``[t_lo, t_hi)`` from the state
        ``b_S [BK, BV]`` fp32 (the recurrence of the module docstring; arguments as
        :func:`_walk_kernel`'s).  Returns the end state and the summed log decay ``[BK]``.

        FACTORED (scalar gates with outputs; every chunk's total log decay at least
        ``-FACTOR_SPAN``, or ``-FACTOR_SPAN_FP16`` for fp16 operands): the in-chunk decay
        ``exp(G_i - G_j)`` is factored as ``exp(G_i - G_C) * exp(G_C - G_j)``.  The right
        factor is the one the state update already puts on the values
        (``v * exp(G_C - G)``), so the intra-chunk term is
        ``exp(G - G_C) * (causal(q k^T) v_upd)``: BT exponentials per chunk instead of
        BT^2, and no gate broadcast along columns.  Within the span ``exp(G_i - G_C)``
        stays finite and ``v_upd`` a normal number of the operand dtype."""
        bos = i_b * T
        DT = k.dtype.element_ty
        NT = tl.cdiv(T, BT)
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]
        b_gt = tl.zeros([BK], dtype=tl.float32)  # the walked tokens' summed log decay
        for t0 in range(t_lo, t_hi, BT):
            if STORE_CHUNKS:
                i_c = i_b * tl.cdiv(T, BT) + t0 // BT
                p_hc = tl.make_block_ptr(hc + (i_c * H + i_h) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
                tl.store(p_hc, b_S.to(p_hc.dtype.element_ty), boundary_check=(0, 1))
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            if K_MAP is not None:
                b_k = mapped_tile(b_k, K_MAP, t0, T, 0, K, BT, BK)
            # values in the operand dtype: an fp32 copy would hold 32 more registers per
            # thread through the chunk (the delta rule's correction makes its own)
            if HAS_V:
                p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
                b_v = tl.load(p_v, boundary_check=(0, 1))
                if V_MAP is not None:
                    b_v = mapped_tile(b_v, V_MAP, t0, T, i_v * BV, V, BT, BV)
            else:
                b_v = tl.zeros([BT, BV], dtype=DT)
            if HAS_W:
                p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
                b_w = tl.load(p_w, boundary_check=(0, 1))
                b_v = b_v.to(tl.float32) - tl.dot(b_w, b_S.to(b_w.dtype), input_precision=PREC)
            if STORE_CHUNKS:
                p_vn = tl.make_block_ptr(vn + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
                tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), boundary_check=(0, 1))

            # gates: in-chunk cumulative log decay G, the chunk total G_C (padding: g = 0)
            if GATE == 1:
                # a scalar gate per token scales rows: (k * d)^T v = k^T (d * v) and
                # (q * e)^T S = e * (q^T S), so the decays go onto the [BT, BV] value and
                # output tiles instead of the [BT, BK] key and query tiles (half the
                # elementwise work at BK = 2 BV, and k, q stay the loaded 16-bit tiles)
                if G_RAW:
                    b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
                else:
                    b_G, b_GC = scalar_gate_cum(g, i_bh, t0, T, BT)
                b_kd = b_k
                b_v_upd = (b_v.to(tl.float32) * tl.exp(b_GC - b_G)[:, None]).to(DT)
            elif GATE == 2:  # pre-gated inputs: only the chunk's total decay is left
                o_kc = tl.arange(0, BK)
                b_GC = tl.load(g + ((i_b * NT + t0 // BT) * H + i_h) * K + o_kc,
                               mask=o_kc < K, other=0.0)
                b_kd = b_k
            else:
                b_kd = b_k
            b_vd = b_v.to(DT)
            if GATE != 1:
                b_v_upd = b_vd

            if STORE_O:
                p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
                b_q = tl.load(p_q, boundary_check=(0, 1))
                if Q_MAP is not None:
                    b_q = mapped_tile(b_q, Q_MAP, t0, T, 0, K, BT, BK)
                if HAS_A:  # the in-chunk attention precomputed (once, not per V tile)
                    b_qg = b_q  # GATE 1: its decay exp(G) scales the output rows below
                    p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
                    b_A = tl.load(p_a, boundary_check=(0, 1))
                elif GATE == 1 and FACTORED:
                    b_qg = b_q
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
                    b_A = tl.where(causal, b_A, 0.0)
                elif GATE == 1:
                    b_qg = b_q  # its decay exp(G) scales the output rows below
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
                    b_A = b_A * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
                else:
                    b_qg = b_q
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
                    b_A = tl.where(causal, b_A, 0.0)
                # inter-chunk (chunk-start state) + intra-chunk
                if GATE == 1 and FACTORED and not HAS_A:
                    # exp(G - G_C) * (exp(G_C) q S + causal(q k^T) v_upd)
                    b_o = tl.dot(b_qg, b_S.to(DT), input_precision=PREC) * tl.exp(b_GC)
                    b_o = tl.dot(b_A.to(DT), b_v_upd, b_o, input_precision=PREC)
                    b_o = b_o * tl.exp(b_G - b_GC)[:, None]
                else:
                    b_o = tl.dot(b_qg, b_S.to(DT), input_precision=PREC)
                    if GATE == 1:
                        b_o = b_o * tl.exp(b_G)[:, None]
                    b_o += tl.dot(b_A.to(DT), b_vd, input_precision=PREC)
                p_o = tl.make_block_ptr(o + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
                tl.store(p_o, (b_o * scale).to(p_o.dtype.element_ty), boundary_check=(0, 1))

            if GATE == 1:
                b_S = b_S * tl.exp(b_GC)
                b_gt += b_GC
            elif GATE == 2:
                b_S = b_S * tl.exp(b_GC)[:, None]
                b_gt += b_GC
            b_S += tl.dot(tl.trans(b_kd), b_v_upd, input_precision=PREC)

        return b_S, b_gt

    @triton.jit
    def _walk_kernel(q, k, v, g, w, h0, o, ht, gt, T, SEG, T0, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     GATE: tl.constexpr, HAS_V: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_HT: tl.constexpr,
                     PREC: tl.constexpr, HAS_A: tl.constexpr = False, a=None,
                     STORE_GT: tl.constexpr = False, HAS_SIN: tl.constexpr = False,
                     s_in=None, cg=None, HT_LAST: tl.constexpr = False,
                     STORE_CHUNKS: tl.constexpr = False, hc=None, vn=None,
                     SCAN_IN: tl.constexpr = False, Q_MAP: tl.constexpr = None,
                     K_MAP: tl.constexpr = None, V_MAP: tl.constexpr = None,
                     G_RAW: tl.constexpr = False, H0_EYE: tl.constexpr = False):
        """Fused chunk walk (see module docstring); grid ``(cdiv(V, BV), B * H, NSEG)``.

        Program ``(i_v, i_bh, i_s)`` walks the tokens ``[T0 + i_s * SEG, T0 + (i_s + 1) *
        SEG)`` (T0 and SEG multiples of BT; one segment from ``T0 = 0``, ``SEG >= T``, is the
        plain fused walk; a later ``T0`` walks one piece of the tokens, as the delta rule's
        summaries do behind its WY factors).
        q, k [B, T, H, K]; v [B, T, H, V]; g: none (GATE=0), the scalar gates' chunk-local
        cumulative sums [B, H, T] fp32 (GATE=1, :func:`chunk_gate_cumsum`) or, for a
        per-channel decay (GATE=2), the chunks' total log decays ``G_C [B, NT, H, K]`` with
        q, k already carrying their in-chunk decays (``q * exp(G)``, ``k * exp(G_C - G)``)
        and the in-chunk attention in ``a [B, T, H, BT]`` (all from
        :func:`.vector.gate_chunks`); HAS_A: that attention (``A_ij`` of the module
        docstring, unscaled, zero above the diagonal) read from ``a`` instead of formed
        per V tile (always for GATE=2); w [B, T, H, K] (HAS_W); h0, ht [NSEG, B, H, K, V] fp32 (the
        segment's start and end state); gt [NSEG, B, H, K] fp32: the segment's summed log
        decay (STORE_GT; broadcast over K for scalar gates); o [B, T, H, V].
        ``HAS_V=False`` means v = 0 (transition-only walks).
        HAS_SIN: a state ``s_in [B, H, K, V]`` fp32 entering the whole walk is folded into
        every segment's start, ``h0 + exp(cg) * s_in`` with ``cg [NSEG + 1, B, H, K]`` the
        log decay from the walk's start to each segment's start (from the segment scan).
        HT_LAST: only the last segment stores its end state, into ``ht [B, H, K, V]``.
        SCAN_IN: the segment scan folded into the output walks: ``h0`` holds every segment's
        end state from a zero start and ``gt`` their summed log decays (the summary launch's
        outputs), and each program folds the segments before its own (and ``s_in``,
        HAS_SIN, before the first) into its start state: no scan launch, and no
        ``[NSEG, B, H, K, V]`` pass between the two walks.
        H0_EYE (no HAS_H0, K == V): the walk starts from the identity, so that its end
        state is the segment's dense transition ``M`` (the delta rule's summary, with
        HAS_V=False): no identity tensor is read.
        G_RAW (GATE=1): ``g`` is the per-token gates ``[B, T, H]`` themselves and each chunk
        sums them in the walk (:func:`scalar_gate_chunk`): no gate-sum launch before it.
        Q_MAP, K_MAP, V_MAP: fused elementwise prologues (:func:`mapped_tile`) applied to
        every q, k, v tile as it is loaded (``None``: the inputs as they are).
        STORE_CHUNKS (for backward passes): every chunk's start state into
        ``hc [B, NT, H, K, V]`` and the values the state update uses (the delta rule's
        corrected ``v - w S``) into ``vn [B, T, H, V]``.
        """
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_s = tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)  # token offsets pass 2**31 at long T
        i_h = i_bh % H
        bos = i_b * T
        DT = k.dtype.element_ty
        i_sbh = i_s * tl.num_programs(1) + i_bh  # this segment's state slot
        NT = tl.cdiv(T, BT)
        t_lo = T0 + i_s * SEG
        t_hi = tl.minimum(T, t_lo + SEG)

        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]

        p_h = tl.make_block_ptr(h0 + i_sbh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        if SCAN_IN:
            b_S = tl.zeros([BK, BV], dtype=tl.float32)
            if HAS_SIN:
                p_si = tl.make_block_ptr(s_in + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
                b_S = tl.load(p_si, boundary_check=(0, 1)).to(tl.float32)
            o_kc = tl.arange(0, BK)
            for j in range(0, i_s):
                i_jbh = j * tl.num_programs(1) + i_bh
                if GATE != 0:
                    b_c = tl.load(gt + i_jbh * K + o_kc, mask=o_kc < K, other=0.0)
                    b_S = b_S * tl.exp(b_c)[:, None]
                p_hj = tl.make_block_ptr(h0 + i_jbh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
                b_S += tl.load(p_hj, boundary_check=(0, 1))
        elif HAS_H0:
            b_S = tl.load(p_h, boundary_check=(0, 1)).to(tl.float32)
        elif H0_EYE:
            o_ki = tl.arange(0, BK)
            o_vj = i_v * BV + tl.arange(0, BV)
            b_S = tl.where((o_ki[:, None] == o_vj[None, :]) & (o_ki[:, None] < K), 1.0, 0.0)
        else:
            b_S = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_SIN and not SCAN_IN:
            p_si = tl.make_block_ptr(s_in + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
            b_si = tl.load(p_si, boundary_check=(0, 1)).to(tl.float32)
            if GATE != 0:
                o_kc = tl.arange(0, BK)
                b_c = tl.load(cg + i_sbh * K + o_kc, mask=o_kc < K, other=0.0)
                b_si = b_si * tl.exp(b_c)[:, None]
            b_S += b_si
        b_gt = tl.zeros([BK], dtype=tl.float32)  # segment's summed log decay (STORE_GT)

        if GATE == 1 and STORE_O and not HAS_A:
            # the factored in-chunk decay where this segment's gates allow it (one check of
            # every chunk's total before the walk: the loop itself stays branch-free)
            SPAN: tl.constexpr = FACTOR_SPAN_FP16 if k.dtype.element_ty == tl.float16 else FACTOR_SPAN
            if _chunk_decays_within(g, i_b, i_h, i_bh, t_lo, t_hi, T, H, BT, G_RAW, SPAN):
                b_S, b_gt = _walk_chunks(q, k, v, g, w, o, a, hc, vn, b_S, i_b, i_h, i_bh,
                                         i_v, t_lo, t_hi, T, scale, H, K, V, BT, BK, BV, GATE,
                                         HAS_V, HAS_W, STORE_O, PREC, HAS_A, STORE_CHUNKS,
                                         Q_MAP, K_MAP, V_MAP, G_RAW, True)
            else:
                b_S, b_gt = _walk_chunks(q, k, v, g, w, o, a, hc, vn, b_S, i_b, i_h, i_bh,
                                         i_v, t_lo, t_hi, T, scale, H, K, V, BT, BK, BV, GATE,
                                         HAS_V, HAS_W, STORE_O, PREC, HAS_A, STORE_CHUNKS,
                                         Q_MAP, K_MAP, V_MAP, G_RAW, False)
        else:
            b_S, b_gt = _walk_chunks(q, k, v, g, w, o, a, hc, vn, b_S, i_b, i_h, i_bh, i_v,
                                     t_lo, t_hi, T, scale, H, K, V, BT, BK, BV, GATE, HAS_V,
                                     HAS_W, STORE_O, PREC, HAS_A, STORE_CHUNKS, Q_MAP, K_MAP,
                                     V_MAP, G_RAW, False)

        if STORE_HT:
            if HT_LAST:
                if i_s == tl.num_programs(2) - 1:
                    p_ht = tl.make_block_ptr(ht + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
                    tl.store(p_ht, b_S, boundary_check=(0, 1))
            else:
                p_ht = tl.make_block_ptr(ht + i_sbh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
                tl.store(p_ht, b_S, boundary_check=(0, 1))
        if STORE_GT:
            if i_v == 0:
                o_k = tl.arange(0, BK)
                tl.store(gt + i_sbh * K + o_k, b_gt, mask=o_k < K)

    @triton.jit
    def _segment_scan_kernel(hs, gt, h0, ht, NSEG, K: tl.constexpr, V: tl.constexpr,
                             BK: tl.constexpr, BV: tl.constexpr, GATED: tl.constexpr,
                             HAS_H0: tl.constexpr, STORE_CG: tl.constexpr = False, cg=None,
                             KEEP_HS: tl.constexpr = False):
        """Scan over segment summaries; grid ``(cdiv(V, BV), B * H)``.

        hs [NSEG, B, H, K, V] fp32 holds each segment's state from a zero start and is
        overwritten with each segment's *incoming* state (unless KEEP_HS); gt [NSEG, B, H,
        K] the segments' summed log decays; h0 [B, H, K, V] the call's initial state; ht
        the final state.  STORE_CG: ``cg [NSEG + 1, B, H, K]`` gets the log decay from the
        start to each segment's start, and in row NSEG the total (written by the
        ``i_v == 0`` programs).
        """
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        NBH = tl.num_programs(1)
        o_k = tl.arange(0, BK)
        if HAS_H0:
            p0 = tl.make_block_ptr(h0 + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
            b_S = tl.load(p0, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_S = tl.zeros([BK, BV], dtype=tl.float32)
        b_c = tl.zeros([BK], dtype=tl.float32)
        for i_s in range(0, NSEG):
            slot = i_s * NBH + i_bh
            p_h = tl.make_block_ptr(hs + slot * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
            b_dS = tl.load(p_h, boundary_check=(0, 1))
            if not KEEP_HS:
                tl.store(p_h, b_S, boundary_check=(0, 1))
            if GATED:
                b_g = tl.load(gt + slot * K + o_k, mask=o_k < K, other=0.0)
                b_S = b_S * tl.exp(b_g)[:, None]
                if STORE_CG:
                    if i_v == 0:
                        tl.store(cg + slot * K + o_k, b_c, mask=o_k < K)
                    b_c += b_g
            b_S += b_dS
        if STORE_CG:
            if i_v == 0:
                tl.store(cg + (NSEG * NBH + i_bh) * K + o_k, b_c, mask=o_k < K)
        p_ht = tl.make_block_ptr(ht + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_ht, b_S, boundary_check=(0, 1))


def use_autotune() -> bool:
    """Autotune only when asked (``FORGE_DIST_AUTOTUNE=1``) and never under the interpreter.

    Opt-in because the one GPU run with autotuning on hit an illegal memory access in the
    scalar-gate walker under some tuning config (not yet isolated); the fixed configs below
    are the ones validated by the GPU tests.
    """
    return not interpreting() and os.environ.get("FORGE_DIST_AUTOTUNE", "0") == "1"


# The walker's tuning space: V tile (parallelism vs q/k re-reads), warps, pipelining depth.
WALK_TUNE = [(bv, nw, ns) for bv in (16, 32, 64) for nw in (4, 8) for ns in (1, 2)]
WALK_KEY = ["H", "K", "V", "BT", "GATE", "HAS_V", "HAS_W", "HAS_H0", "STORE_O", "HAS_A",
            "STORE_GT"]

if HAVE_TRITON:
    _walk_tuned = triton.autotune(
        configs=[triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in WALK_TUNE],
        key=WALK_KEY)(_walk_kernel)


def chunk_gate_cumsum(g: Tensor, BT: int, g_map=None) -> Tensor:
    """Scalar log decays ``g [B, T, H]`` (any float dtype) -> their cumulative sums within
    each ``BT``-token chunk, head-major: ``[B, H, T]`` fp32 (what the walker reads for
    ``gate=1``; one small launch).  ``g_map``: a fused prologue applied to ``g`` first."""
    B, T, H = g.shape
    gc = torch.empty(B, H, T, dtype=torch.float32, device=g.device)
    ln = gate_cumsum_launch(g="g", gc="gc", B=B, T=T, H=H, BT=BT,
                            maps=None if g_map is None else {"g": g_map})
    run_launch(ln, {"g": g.contiguous(), "gc": gc}, _gate_cumsum_kernel)
    return gc


# Up to this many tokens (B * T) the walks sum the scalar gates per chunk themselves
# (``G_RAW``, fp32 gathers of stride H) instead of reading a gate sum launched before them.
# H200, B=1, H=32, K=V=128 bf16, GPU time of the whole forward
# (results/kernel_profile_gate-sum_NVIDIA-H200_2026-11-25_s24.json): within 0.5 % from 1K to 32K
# tokens (32K: 735 vs 734 us), and one launch (~7 us of host time) fewer; 8 % slower at 64K
# and 256K, where the sum's contiguous reads pipeline and the gathers do not.  The delta
# rule's fused walk keeps the launch (kernels.delta: it was 9 % slower summing in the walk).
SUM_GATES_IN_WALK_MAX_TOKENS = 32768


def sum_gates_in_walk(B: int, T: int, g_map=None) -> bool:
    """Whether the walks read the per-token scalar gates and sum each chunk themselves (not
    with a fused gate prologue ``g_map``: the gate-sum kernel applies that one)."""
    return g_map is None and B * T <= SUM_GATES_IN_WALK_MAX_TOKENS


def walker_gates(g: Optional[Tensor], gate: int, BT: int,
                 g_cum: Optional[Tensor] = None, g_map=None) -> Optional[Tensor]:
    """The gate tensor the walker reads: for ``gate=1`` the chunk-local cumulative sums
    (``g_cum``, or computed from ``g`` through ``g_map``), otherwise ``g`` as given."""
    if gate != 1:
        return g
    return g_cum if g_cum is not None else chunk_gate_cumsum(g, BT, g_map)


def _tiles(k: Tensor, V: int, cfg: dict):
    """``(BT, BK, BV, NV)`` of the walker for keys ``k`` and value dim ``V``."""
    BV = min(cfg["BV"], next_pow2(V))
    return cfg["BT"], next_pow2(k.shape[-1]), BV, cdiv(V, BV)


def _launch_walk(n: int, seg: int, *, q, k, v, g, gate, w, h0, o, ht, gt, store_ht, scale,
                 V, cfg, prec, a=None, s_in=None, cg=None, ht_last=False, hc=None,
                 vn=None, scan_in=False, maps=None, raw_gates=False) -> None:
    """One walker launch over ``n`` segments of ``seg`` tokens (the launch record of
    :func:`.walker_launches.walk_launch`, bound to these tensors);
    ``raw_gates``: ``g`` is the per-token scalar gates, summed in the walk (``G_RAW``)."""
    B, T, H, K = k.shape
    given = dict(q=q, k=k, v=v, g=g, w=w, h0=h0, o=o, ht=ht, gt=gt, a=a, s_in=s_in, cg=cg,
                 hc=hc, vn=vn)
    tensors = {name: t for name, t in given.items() if t is not None}
    names = {name: (name if t is not None else None) for name, t in given.items()}
    ln = walk_launch(**names, B=B, T=T, H=H, K=K, V=V, gate=gate, scale=scale, cfg=cfg,
                     prec=prec, seg=seg, n=n, store_ht=store_ht, ht_last=ht_last,
                     scan_in=scan_in, maps=maps, raw_gates=raw_gates)
    _run_walker(ln, tensors, cfg)


def _run_walker(ln, tensors: Dict[str, Tensor], cfg: dict) -> None:
    """Launch a record of :mod:`.walker_launches` on ``tensors`` (by buffer name); walks
    are autotuned with ``FORGE_DIST_AUTOTUNE=1`` (not those keeping chunk states)."""
    if ln.kernel == "walk":
        consts = dict(ln.constexprs)
        if use_autotune() and cfg.get("tune", True) and not consts["STORE_CHUNKS"]:
            call = {name: tensors[value] if kind == "buf" else value
                    for name, kind, value in ln.args}
            del consts["BV"]  # BV, warps and stages come from the tuning configs
            NV_of = lambda meta: cdiv(consts["V"], meta["BV"])  # noqa: E731
            _walk_tuned[lambda meta: (NV_of(meta),) + ln.grid[1:]](**call, **consts)
            return
        run_launch(ln, tensors, _walk_kernel)
    elif ln.kernel == "segment_scan":
        run_launch(ln, tensors, _segment_scan_kernel)
    else:
        run_launch(ln, tensors, _gate_cumsum_kernel)


def _walk_schedule(present: tuple, B: int, T: int, H: int, K: int, V: int, gate: int,
                   scale: float, cfg: dict, prec: str, n_seg: int, maps, raw_gates: bool):
    """``(launches, workspaces)`` of :func:`.walker_launches.walk_launches` for the
    tensors named in ``present`` (every other input absent); kept per shape and tile config
    unless ``maps`` (prologue functions) are given: building them is about 10 us of Python
    per eager call, which host-bound calls of a few K tokens pay in full."""
    if maps:
        return _build_schedule(present, B, T, H, K, V, gate, scale, cfg, prec, n_seg, maps,
                               raw_gates)
    return _kept_schedule(present, B, T, H, K, V, gate, float(scale), tuple(cfg.items()),
                          prec, n_seg, raw_gates)


@functools.lru_cache(maxsize=256)
def _kept_schedule(present, B, T, H, K, V, gate, scale, config, prec, n_seg, raw_gates):
    return _build_schedule(present, B, T, H, K, V, gate, scale, dict(config), prec, n_seg,
                           None, raw_gates)


def _build_schedule(present, B, T, H, K, V, gate, scale, cfg, prec, n_seg, maps, raw_gates):
    names = {n: (n if n in present else None)
             for n in ("q", "k", "v", "g", "w", "h0", "o", "ht", "a", "hc", "vn")}
    workspaces: Dict[str, Buffer] = {}
    launches = walk_launches(workspaces, **names, B=B, T=T, H=H, K=K, V=V, gate=gate,
                             scale=scale, cfg=cfg, prec=prec, n_seg=n_seg, maps=maps,
                             raw_gates=raw_gates)
    return tuple(launches), tuple(workspaces.items())


def walk(k: Tensor, v: Optional[Tensor], *, q: Optional[Tensor] = None, g: Optional[Tensor] = None,
         gate: int = 0, w: Optional[Tensor] = None, h0: Optional[Tensor] = None,
         scale: float = 1.0, V: Optional[int] = None, out_dtype=torch.float32,
         cfg: dict, prec: str, a: Optional[Tensor] = None, n_seg: int = 1,
         chunk_states: Optional[Tensor] = None, walked_v: Optional[Tensor] = None,
         g_cum: Optional[Tensor] = None, maps: Optional[dict] = None,
         raw_gates: Optional[bool] = None):
    """Run the walker: FUSED (``n_seg == 1``) or DECOUPLED over ``n_seg`` segments.

    DECOUPLED (the paper's appendix B.2 at segment granularity): every segment's summary from
    a zero start in parallel (``(V tiles, B * H, n_seg)`` programs), then every segment's
    outputs in parallel, each program folding the summaries of the segments before its own
    into its start state (the scan over segments, ``SCAN_IN``; without outputs the scan runs
    alone, ``_segment_scan_kernel``).  It re-reads k and v once more than FUSED but multiplies the parallelism by
    ``n_seg``; the scheduler weighs the two.  Segments need a diagonal or scalar transition,
    so the delta rule (``w``) walks fused.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` or ``None`` (zeros; then pass ``V``).
        q: ``[B, T, H, K]`` or ``None`` (summary: no outputs).
        g: gate per ``gate`` (0 none, 1 ``[B, T, H]``, 2 ``[B, T, H, K]``).
        g_cum: for ``gate=1``, ``chunk_gate_cumsum(g, BT)`` when the caller already has it
            (else it is computed here).
        w: WY correction ``[B, T, H, K]`` (delta rule) or ``None``.
        h0: incoming state ``[B, H, K, V]`` fp32 or ``None`` (zeros).
        cfg: tile config with ``BT, BV, num_warps, num_stages`` (BV/warps/stages are
            autotuned with ``FORGE_DIST_AUTOTUNE=1``; the key excludes T).
        a: precomputed intra-chunk attention ``[B, T, H, BT]`` fp32 (vector decay).
        n_seg: segments for the decoupled schedule (1: fused).
        chunk_states, walked_v: fused only, for backward passes: filled with every chunk's
            start state ``[B, NT, H, K, V]`` and the values the state update used
            ``[B, T, H, V]`` (the delta rule's ``v - w S``); pass both or neither.
        maps: fused elementwise prologues by input name (``q, k, v, g``; jitted maps of
            :mod:`forge_dist.dsl.codegen`): the walk reads the raw inputs and maps each tile.
        raw_gates: ``gate=1`` only: the walks sum ``g`` per chunk themselves instead of
            reading a ``chunk_gate_cumsum`` launched before them; ``None``:
            :func:`sum_gates_in_walk` decides (not with ``g_cum`` or a gate map).
    Returns:
        ``(o [B, T, H, V] in out_dtype or None, final state [B, H, K, V] fp32)``.
    """
    B, T, H, K = k.shape
    V = v.shape[-1] if v is not None else V
    seg = segment_length(T, cfg["BT"], n_seg)
    n_seg = max(1, -(-T // seg))
    if n_seg > 1 and w is not None:
        raise ValueError("walk: the decoupled schedule needs a scalar or diagonal transition "
                         "(the delta rule's dense one walks fused)")
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    o = torch.empty(B, T, H, V, dtype=out_dtype, device=k.device) if q is not None else None
    if h0 is not None:
        h0 = h0.to(torch.float32).contiguous()
    g_map = (maps or {}).get("g")
    if raw_gates is None:
        raw_gates = gate == 1 and g_cum is None and sum_gates_in_walk(B, T, g_map)
    if raw_gates:
        if gate != 1 or g_cum is not None or g_map is not None:
            raise ValueError("walk: raw_gates needs gate=1, no g_cum and no gate map")
        g = g.contiguous()
    else:
        g = walker_gates(g, gate, cfg["BT"], g_cum, g_map)
    if (chunk_states is None) != (walked_v is None):
        raise ValueError("walk: chunk_states and walked_v go together")
    if chunk_states is not None and n_seg != 1:
        raise ValueError("walk: chunk_states needs the fused schedule (n_seg=1)")
    if n_seg == 1 and h0 is None and gate == 0 and w is None and q is not None:
        # The ungated output walk compiled without an incoming state ran at 1.96 ms
        # against 1.39 ms with a zero one (H200, B=4, 32K tokens, 32 heads of 128,
        # results/sp_phases_*, the h0 probe of the 2026-11-24 session): start from zeros.
        h0 = torch.zeros(B, H, K, V, dtype=torch.float32, device=k.device)
    given = dict(q=q, k=k, v=v, g=g, w=w, h0=h0, o=o, ht=ht, a=a, hc=chunk_states,
                 vn=walked_v)
    tensors = {name: t for name, t in given.items() if t is not None}
    launches, workspaces = _walk_schedule(tuple(tensors), B, T, H, K, V, gate, scale, cfg,
                                          prec, n_seg, maps, raw_gates)
    for name, buf in workspaces:  # the decoupled schedule's segment states
        tensors[name] = torch.empty(buf.shape, dtype=buf.dtype, device=k.device)
    for ln in launches:
        _run_walker(ln, tensors, cfg)
    return o, ht


@dataclass
class SegmentStates:
    """A shard's local summary, kept so that its outputs need no second summary pass.

    ``starts [n_seg, B, H, K, V]`` fp32: each segment's incoming state from a zero start;
    ``decay_to [n_seg + 1, B, H, K]`` fp32 (gated): log decay from the shard start to each
    segment's start, row ``n_seg`` the whole shard's (``None`` without a gate);
    ``delta [B, H, K, V]`` fp32: the shard's state from a zero start.  ``n_seg == 1`` keeps
    no ``starts`` (the single segment starts at the shard start).  ``g_cum [B, H, T]``: a
    scalar gate's chunk-local cumulative sums, which the output walks read again.
    """

    n_seg: int
    seg: int
    delta: Tensor
    starts: Optional[Tensor]
    decay_to: Optional[Tensor]
    g_cum: Optional[Tensor] = None

    def total_log_decay(self) -> Optional[Tensor]:
        """``[B, H, K]``: the shard's summed log decay (``None`` without a gate)."""
        return None if self.decay_to is None else self.decay_to[self.n_seg]


def summarize(k: Tensor, v: Tensor, *, g: Optional[Tensor] = None, gate: int = 0,
              cfg: dict, prec: str, n_seg: int = 1, maps: Optional[dict] = None
              ) -> SegmentStates:
    """Phase 1 of the sequence-parallel step: the shard's summary, with its segment states.

    Runs the segment summaries and (``n_seg > 1``) the segment scan from a zero start;
    :func:`outputs_from_summary` then runs only the segments' output walks once the incoming
    state is known.  Shapes as in :func:`walk`.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT, BK, BV, NV = _tiles(k, V, cfg)
    seg = segment_length(T, BT, n_seg)
    n_seg = max(1, -(-T // seg))
    g = walker_gates(g, gate, BT, g_map=(maps or {}).get("g"))
    g_cum = g if gate == 1 else None
    common = dict(k=k, v=v, g=g, gate=gate, w=None, scale=1.0, V=V, cfg=cfg, prec=prec,
                  maps=maps)
    hs = torch.empty(n_seg, B, H, K, V, dtype=torch.float32, device=k.device)
    gt = torch.empty(n_seg, B, H, K, dtype=torch.float32, device=k.device) if gate else None
    _launch_walk(n_seg, seg, q=None, h0=None, o=None, ht=hs, gt=gt, store_ht=True, **common)
    if n_seg == 1:
        decay_to = None
        if gt is not None:
            decay_to = torch.cat([torch.zeros_like(gt), gt])
        return SegmentStates(1, seg, hs[0], None, decay_to, g_cum)
    delta = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    decay_to = (torch.empty(n_seg + 1, B, H, K, dtype=torch.float32, device=k.device)
                if gate else None)
    scan = segment_scan_launch(hs="hs", gt="gt" if gt is not None else None, h0=None,
                               ht="delta", cg="cg" if decay_to is not None else None,
                               n_seg=n_seg, B=B, H=H, K=K, V=V, cfg=cfg)
    tensors = {"hs": hs, "gt": gt, "delta": delta, "cg": decay_to}
    _run_walker(scan, {n: t for n, t in tensors.items() if t is not None}, cfg)
    return SegmentStates(n_seg, seg, delta, hs, decay_to, g_cum)


def outputs_from_summary(summ: SegmentStates, k: Tensor, v: Tensor, *, q: Tensor,
                         g: Optional[Tensor] = None, gate: int = 0,
                         S_in: Optional[Tensor] = None, scale: float = 1.0,
                         out_dtype=torch.float32, cfg: dict, prec: str,
                         a: Optional[Tensor] = None, maps: Optional[dict] = None):
    """Phase 3: ``(o, final state)`` of the shard given its incoming state ``S_in``.

    Every segment starts from ``starts[s] + exp(decay_to[s]) * S_in`` (folded into the
    walker's first step), so the summary's work is not redone; the last segment's walk ends
    on the final state.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if S_in is not None:
        S_in = S_in.to(torch.float32).contiguous()
    o = torch.empty(B, T, H, V, dtype=out_dtype, device=k.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    g = walker_gates(g, gate, cfg["BT"], summ.g_cum, (maps or {}).get("g"))
    common = dict(k=k, v=v, g=g, gate=gate, w=None, scale=scale, V=V, cfg=cfg, prec=prec, a=a,
                  maps=maps)
    if summ.n_seg == 1:
        _launch_walk(1, summ.seg, q=q, h0=S_in, o=o, ht=ht, gt=None, store_ht=True, **common)
    else:
        _launch_walk(summ.n_seg, summ.seg, q=q, h0=summ.starts, o=o, ht=ht, gt=None,
                     store_ht=True, s_in=S_in, cg=summ.decay_to, ht_last=True, **common)
    return o, ht

"""Triton backward pass of the delta rule (gated_delta_rule; DeltaNet without ``g``).

Forward, per chunk of ``BT = 64`` tokens (:mod:`.delta`, :mod:`forge_dist.variants.delta_rule`),
with ``S`` the chunk-start state ``[K, V]``, ``G`` the in-chunk cumulative log decay, ``G_C``
its total, ``b`` = beta and ``X = (I + Aw)^{-1}``, ``Aw_ij = b_i (k_i . k_j) exp(G_i - G_j)``
for ``j < i``::

    W  = X diag(b e^G) K,   U = X diag(b) V                          (WY factors)
    v' = U - W S                                                      (corrected values)
    o  = scale [ (q e^G) S + (Aq o Dc) v' ],   Aq = q k^T, Dc_ij = e^{G_i - G_j} (i >= j)
    S' = e^{G_C} S + (k e^{G_C - G})^T v'

Backward, with ``dS'`` the gradient w.r.t. the chunk's end state::

    dv' = scale (Aq o Dc)^T do + (k e^{G_C - G}) dS'
    dS  = e^{G_C} dS' + scale (q e^G)^T do - W^T dv'                  (reverse walk)
    dq  = scale (do S^T) e^G + scale (dAq o Dc) k,       dAq = do v'^T
    dk  = (v' dS'^T) e^{G_C - G} + scale (dAq o Dc)^T q  + [from W, U, Aw below]
    dW  = -dv' S^T,   dU = dv'
    dX  = dW (diag(b e^G) K)^T + dU (diag(b) V)^T,   dAw = -X^T dX X^T (strictly lower)
    dK += diag(b e^G) X^T dW + (dAw b o D) K + (dAw b o D)^T K,   dV = diag(b) X^T dU
    db  = e^G (k . X^T dW) + (v . X^T dU) + rowsum(dAw o K K^T o D)

Gate: every term carrying ``e^{+G_i}`` adds its ``<grad, value>`` to ``dG_i``, every term
carrying ``e^{-G_j}`` subtracts it from ``dG_j``, and the end-state terms go to ``dG_C``::

    dG_i = q_i . dq_i - k_i . dk_i^{(Aq, S')} + b_i e^{G_i} k_i . (X^T dW)_i
           + sum_j (dAw o Aw)_ij - sum_j (dAw o Aw)_ji
    dG_C = e^{G_C} <S, dS'> + sum_j k_j . dk_j^{(S')}
    dg_t = sum_{i >= t} dG_i + dG_C       (in-chunk reverse cumulative sum)

This is the direct form: at steep gates (log decays near -20 per token) ``dg`` stays finite
but loses relative precision, as FLA's does (the scalar-decay backward avoids this with a
straddling form, :mod:`.scalar_backward`; the delta rule's W and Aw terms have no such form
here yet).  Every exponent is a non-positive difference masked before ``exp``.

Launches:

1. ``wy`` (:mod:`.delta`) recomputes ``W, U`` and keeps ``X [B, T, H, BT]`` fp32;
2. the shared walker (:func:`.walker.walk`) re-walks the state, keeping every chunk-start
   state ``S [B, NT, H, K, V]`` and ``v' [B, T, H, V]``;
3. ``_dstates_kernel``, grid ``(V tiles, B * H)``: the reverse walk, keeping ``dS'`` per
   chunk and ``dv'``, and giving the incoming state's gradient;
4. ``_dqk_kernel``, chunk-parallel, grid ``(NT, K tiles, B * H)``: dq, the ``Aq``/``S'``
   parts of dk, dW, and per K tile the first part of ``dG``;
5. ``_wy_bwd_kernel``, chunk-parallel, grid ``(NT, B * H)``: the WY and ``Aw`` parts, dv,
   dbeta, and dg (the in-chunk reverse cumulative sum).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import delta
from .compat import HAVE_TRITON, cdiv, dot_precision, next_pow2, tl, triton
from .ir import Buffer, Launch, Program, buffer_args, state_buffers
from .tiles import scalar_gate_chunk, value_state_tiles
from .walker import sum_gates_in_walk
from .walker_launches import gate_cumsum, segment_length, walk_launch

__all__ = ["default_tiles", "delta_rule_backward", "kernel_specs"]

BT_DELTA = 64  # the blocked WY inverse's chunk


if HAVE_TRITON:

    @triton.jit
    def _dstates_kernel(q, k, w, g, do, dht, dhc, dvn, dh0, T, NT, scale, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, GATE: tl.constexpr, HAS_DHT: tl.constexpr,
                        STORE_DH0: tl.constexpr, PREC: tl.constexpr,
                        STORE_STATES: tl.constexpr = True):
        """Reverse walk; grid ``(cdiv(V, BV), B * H)``, the whole K per program (``W^T dv'``
        mixes every row of the state).  ``dhc [B, NT, H, K, V]``: gradient w.r.t. each
        chunk's end state; ``dvn [B, T, H, V]`` fp32: ``dv'``; ``dh0 [B, H, K, V]`` fp32.
        ``STORE_STATES=False``: ``dh0`` only (``kernels.state_grad_program``)."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        DT = k.dtype.element_ty
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]
        if HAS_DHT:
            p_t = tl.make_block_ptr(dht + (i_b * H + i_h) * K * V, (K, V), (V, 1),
                                    (0, i_v * BV), (BK, BV), (1, 0))
            b_dh = tl.load(p_t, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        for i in range(NT):
            c = NT - 1 - i
            t0 = c * BT
            p_dh = tl.make_block_ptr(dhc + ((i_b * NT + c) * H + i_h) * K * V, (K, V), (V, 1),
                                     (0, i_v * BV), (BK, BV), (1, 0))
            if STORE_STATES:
                tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), boundary_check=(0, 1))
            p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0),
                                    (BT, BK), (1, 0))
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0),
                                    (BT, BK), (1, 0))
            p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0),
                                    (BT, BK), (1, 0))
            p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                     (t0, i_v * BV), (BT, BV), (1, 0))
            b_q = tl.load(p_q, boundary_check=(0, 1))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_w = tl.load(p_w, boundary_check=(0, 1)).to(DT)
            b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            if GATE:
                b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
                b_A = b_A * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
                b_kd = (b_k.to(tl.float32) * tl.exp(b_GC - b_G)[:, None]).to(DT)
                b_qg = (b_q.to(tl.float32) * tl.exp(b_G)[:, None]).to(DT)
            else:
                b_A = tl.where(causal, b_A, 0.0)
                b_kd = b_k
                b_qg = b_q
            b_dvn = tl.dot(tl.trans(b_A * scale).to(DT), b_do, input_precision=PREC)
            b_dvn += tl.dot(b_kd, b_dh.to(DT), input_precision=PREC)
            p_dvn = tl.make_block_ptr(dvn + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                      (t0, i_v * BV), (BT, BV), (1, 0))
            if STORE_STATES:
                tl.store(p_dvn, b_dvn.to(p_dvn.dtype.element_ty), boundary_check=(0, 1))
            if GATE:
                b_dh = b_dh * tl.exp(b_GC)
            b_dh += tl.dot(tl.trans(b_qg), b_do, input_precision=PREC) * scale
            b_dh -= tl.dot(tl.trans(b_w), b_dvn.to(DT), input_precision=PREC)
        if STORE_DH0:
            p_0 = tl.make_block_ptr(dh0 + (i_b * H + i_h) * K * V, (K, V), (V, 1),
                                    (0, i_v * BV), (BK, BV), (1, 0))
            tl.store(p_0, b_dh, boundary_check=(0, 1))

    @triton.jit
    def _dqk_kernel(q, k, g, hc, dhc, vn, dvn, do, dq, dk, dw, dG, T, NT, NBT, scale,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
        """Chunk-parallel; grid ``(NT, cdiv(K, BK), B * H)``.  Writes dq (final), the
        ``Aq``/``S'`` parts of dk and dW = -dv' S^T (fp32 ``[B, T, H, K]``), and this K tile's
        share of ``dG`` (``dG [NK, B, T, H]`` fp32; ``dG_C`` folded into the chunk's last
        token, so that the reverse cumulative sum hands it to every token)."""
        # chunks on axis 0: CUDA caps axes 1 and 2 at 65535 blocks (T = 4M at BT = 64)
        i_t, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        DT = k.dtype.element_ty
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, i_k * BK),
                                (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, i_k * BK),
                                (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]

        b_dA = tl.zeros([BT, BT], dtype=tl.float32)  # dAq[i, j] = do_i . v'_j
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)
        base_h = ((i_b * NT + i_t) * H + i_h) * K * V
        for i_v in range(tl.cdiv(V, BV)):
            b_vn, b_do, b_ht, b_dht = value_state_tiles(vn, do, hc, dhc, bos, i_h, t0, i_v,
                                                        i_k, base_h, T, H, K, V, BT, BK, BV)
            b_vn, b_do = b_vn.to(DT), b_do.to(DT)
            p_dvn = tl.make_block_ptr(dvn + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                      (t0, i_v * BV), (BT, BV), (1, 0))
            b_dvn = tl.load(p_dvn, boundary_check=(0, 1)).to(DT)
            b_dA += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
            b_dq += tl.dot(b_do, b_ht.to(DT), input_precision=PREC)
            b_dk += tl.dot(b_vn, b_dht.to(DT), input_precision=PREC)
            b_dw += tl.dot(b_dvn, b_ht.to(DT), input_precision=PREC)
            if GATE:
                b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)

        if GATE:
            b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_dA = b_dA * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
            b_dq = b_dq * (tl.exp(b_G) * scale)[:, None]
            b_dk = b_dk * tl.exp(b_GC - b_G)[:, None]  # the S' part
        else:
            b_dA = tl.where(causal, b_dA, 0.0)
            b_dq = b_dq * scale
        b_dA = (b_dA * scale).to(DT)
        b_dq += tl.dot(b_dA, b_k, input_precision=PREC)
        b_dkA = tl.dot(tl.trans(b_dA), b_q, input_precision=PREC)
        if GATE:
            b_kf = b_k.to(tl.float32)
            b_kdk_end = tl.sum(b_kf * b_dk, axis=1)
            b_dGv = (tl.sum(b_q.to(tl.float32) * b_dq, axis=1) - tl.sum(b_kf * b_dkA, axis=1)
                     - b_kdk_end)
            b_dGC = tl.exp(b_GC) * tl.sum(b_hdh, axis=0) + tl.sum(b_kdk_end, axis=0)
            last = tl.minimum(T - t0, BT) - 1  # the chunk's last real token
            b_dGv = tl.where(rows == last, b_dGv + b_dGC, b_dGv)
            o_t = t0 + rows
            tl.store(dG + (i_k * NBT + bos + o_t) * H + i_h, b_dGv, mask=o_t < T)
        b_dk += b_dkA
        p_dq = tl.make_block_ptr(dq + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, i_k * BK),
                                 (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, i_k * BK),
                                 (BT, BK), (1, 0))
        p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, i_k * BK),
                                 (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
        tl.store(p_dk, b_dk, boundary_check=(0, 1))
        tl.store(p_dw, -b_dw, boundary_check=(0, 1))

    @triton.jit
    def _wy_bwd_kernel(k, v, g, beta, xs, dvn, dw, dk_part, dG, dk, dv, dbeta, dg, T, NK,
                       NBT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, PREC: tl.constexpr):
        """Chunk-parallel; grid ``(NT, B * H)``.  The WY factors' and ``Aw``'s backward (module
        docstring), in fp32 from fp32 ``X``, ``dW``, ``dv'``; two passes over K tiles (the
        first sums ``dX`` and ``K K^T`` over K, the second writes dk)."""
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        rows = tl.arange(0, BT)
        o_t = t0 + rows
        strict = rows[:, None] > rows[None, :]
        b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=o_t < T, other=0.0).to(tl.float32)
        if GATE:
            b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_eG = tl.exp(b_G)
        else:
            b_G = tl.zeros([BT], dtype=tl.float32)
            b_eG = tl.full([BT], 1.0, tl.float32)
        b_eb = b_b * b_eG
        p_x = tl.make_block_ptr(xs + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0),
                                (BT, BT), (1, 0))
        b_Xt = tl.trans(tl.load(p_x, boundary_check=(0, 1)))

        # pass 1 over K: dX's W part, K K^T, and k . (X^T dW) per row
        b_dX = tl.zeros([BT, BT], dtype=tl.float32)
        b_P = tl.zeros([BT, BT], dtype=tl.float32)
        b_kXdw = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                    (t0, i_k * BK), (BT, BK), (1, 0))
            p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                     (t0, i_k * BK), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
            b_dw = tl.load(p_dw, boundary_check=(0, 1))
            b_dX += tl.dot(b_dw, tl.trans(b_k * b_eb[:, None]), input_precision=PREC)
            b_P += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
            b_kXdw += tl.sum(b_k * tl.dot(b_Xt, b_dw, input_precision=PREC), axis=1)
        b_db = b_kXdw * b_eG
        # V tiles: dv, dX's U part, v . (X^T dU)
        for i_v in range(tl.cdiv(V, BV)):
            p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                    (t0, i_v * BV), (BT, BV), (1, 0))
            p_du = tl.make_block_ptr(dvn + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                     (t0, i_v * BV), (BT, BV), (1, 0))
            b_v = tl.load(p_v, boundary_check=(0, 1)).to(tl.float32)
            b_du = tl.load(p_du, boundary_check=(0, 1)).to(tl.float32)
            b_XdU = tl.dot(b_Xt, b_du, input_precision=PREC)
            p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                     (t0, i_v * BV), (BT, BV), (1, 0))
            tl.store(p_dv, (b_XdU * b_b[:, None]).to(p_dv.dtype.element_ty),
                     boundary_check=(0, 1))
            b_db += tl.sum(b_XdU * b_v, axis=1)
            b_dX += tl.dot(b_du, tl.trans(b_v * b_b[:, None]), input_precision=PREC)
        # X = (I + Aw)^{-1}: dAw = -X^T dX X^T, strictly lower
        b_dAw = -tl.dot(tl.dot(b_Xt, b_dX, input_precision=PREC), b_Xt, input_precision=PREC)
        # e^{G_i - G_j} on the strictly lower part, recomputed where needed (registers)
        b_dAw = b_dAw * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))
        # from here b_dAw holds dAw o D: dAw o Aw = b (dAw o D) o P and
        # d/d(k_i . k_j) of Aw_ij = b_i (dAw o D)_ij
        b_P = b_P * b_dAw
        b_db += tl.sum(b_P, axis=1)
        b_Md = b_dAw * b_b[:, None]

        # pass 2 over K: dk = parts from _dqk_kernel + diag(b e^G) X^T dW + (Md + Md^T) K
        for i_k in range(tl.cdiv(K, BK)):
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                    (t0, i_k * BK), (BT, BK), (1, 0))
            p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                     (t0, i_k * BK), (BT, BK), (1, 0))
            p_dkp = tl.make_block_ptr(dk_part + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                      (t0, i_k * BK), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
            b_dw = tl.load(p_dw, boundary_check=(0, 1))
            b_dk = tl.load(p_dkp, boundary_check=(0, 1))
            b_dk += tl.dot(b_Xt, b_dw, input_precision=PREC) * b_eb[:, None]
            b_dk += tl.dot(b_Md, b_k, input_precision=PREC)
            b_dk += tl.dot(tl.trans(b_Md), b_k, input_precision=PREC)
            p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                     (t0, i_k * BK), (BT, BK), (1, 0))
            tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
        tl.store(dbeta + (bos + o_t) * H + i_h, b_db, mask=o_t < T)

        if GATE:
            b_dGv = tl.zeros([BT], dtype=tl.float32)
            for i_p in range(NK):  # the K tiles' shares from _dqk_kernel
                b_dGv += tl.load(dG + (i_p * NBT + bos + o_t) * H + i_h, mask=o_t < T,
                                 other=0.0)
            b_Aw = b_P * b_b[:, None]  # dAw o Aw
            b_dGv += b_kXdw * b_eb + tl.sum(b_Aw, axis=1) - tl.sum(b_Aw, axis=0)
            b_dg = tl.cumsum(b_dGv, axis=0, reverse=True)
            tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=o_t < T)


def default_tiles(K: int, V: int) -> dict:
    """Tiles per kernel, chosen from ptxas's register report for sm_90 (no GPU timing yet):
    the reverse walk holds a ``[K, BV]`` fp32 state plus three ``[BT, K]`` operand tiles, so
    its V tile is narrow (32; 16 with 8 warps at K = 256: a few hundred bytes of spills
    remain there); the chunk-parallel kernels tile K and V and use 8 warps (no spills at
    K = V = 64..256 with these tiles)."""
    PK, PV = next_pow2(K), next_pow2(V)
    wide = PK >= 256
    return _safe_warps({"walk_BV": min(16 if wide else 32, PV), "walk_warps": 8 if wide else 4,
                        "walk_stages": 2, "dqk_BK": min(64, PK), "dqk_BV": min(64, PV),
                        "dqk_stages": 2, "wy_BK": min(32, PK), "wy_BV": min(32, PV),
                        "wy_stages": 3})  # Triton's default, what the WY backward was timed with


def _safe_warps(cfg: dict, given: dict | None = None) -> dict:
    """``cfg`` with the dq/dk and WY kernels' warps (unless ``given`` sets them): 8 only
    where both of the kernel's tiles are at least 32 wide.  Compiled by Triton 3.6 for
    sm_90, the 8-warp kernels with a 16-wide tile made illegal memory accesses on an H100
    (dq/dk at fp32 K = V = 16; the WY backward at fp32 K or V = 16 and bf16 K = V = 16;
    ``results/logs/delta_bwd_small_dims_*_s28.log``); 4 warps run them all."""
    given = given or {}
    for name in ("dqk", "wy"):
        if f"{name}_warps" not in given:
            cfg[f"{name}_warps"] = 8 if min(cfg[f"{name}_BK"], cfg[f"{name}_BV"]) >= 32 else 4
    return cfg


def backward_program(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype,
                     gated: bool, has_h0: bool, has_dht: bool, scale: float, prec: str,
                     beta_dtype: torch.dtype = torch.float32,
                     do_dtype: torch.dtype | None = None, tiles: dict | None = None):
    """The launches of :func:`delta_rule_backward` as a
    :class:`~forge_dist.kernels.ir.Program` (one source for the function, the plans'
    backward and the AOT cache).

    Buffers: inputs ``q, k [B, T, H, K]``, ``v`` and ``do [B, T, H, V]`` (``dtype``;
    ``do_dtype`` for ``do`` when it differs), ``g`` fp32 ``[B, T, H]`` (``gated``), ``beta
    [B, T, H]`` (``beta_dtype``), ``h0`` and ``dht`` fp32 ``[B, H, K, V]`` (``has_h0``,
    ``has_dht``); outputs ``dq, dk, dv`` (``dtype``), ``dg`` (``gated``) and ``dbeta`` fp32
    ``[B, T, H]``, ``dh0`` fp32 (``has_h0``); scratch: the WY factors ``w, u`` and ``xs``,
    the chunk states ``hc`` and corrected values ``vn``, the walk's unread final state
    ``ht`` (and its gate sums ``g_cum`` where the walk does not sum the gates itself), the
    reverse walk's ``dhc, dvn``, and the partial gradients ``dk_part, dw, dG``.
    """
    cfg = default_tiles(K, V)
    if tiles:
        cfg = _safe_warps(dict(cfg, **tiles), tiles)  # the warps follow overridden tiles
    BT = BT_DELTA
    NT = cdiv(T, BT)
    NK = cdiv(K, cfg["dqk_BK"])
    f32 = torch.float32
    low = dtype in (torch.float16, torch.bfloat16)
    wy_prec = "tf32" if low and prec != "ieee" else prec
    sdt = f32 if dtype == f32 else dtype  # stored states: what the dots consume
    scale = float(scale)
    bufs = {"q": Buffer((B, T, H, K), dtype, "input"), "k": Buffer((B, T, H, K), dtype, "input"),
            "v": Buffer((B, T, H, V), dtype, "input"),
            "beta": Buffer((B, T, H), beta_dtype, "input"),
            "do": Buffer((B, T, H, V), do_dtype or dtype, "input"),
            "w": Buffer((B, T, H, K), dtype, "scratch"), "u": Buffer((B, T, H, V), dtype, "scratch"),
            "xs": Buffer((B, T, H, BT), delta.wy_x_dtype(dtype, store_x=True), "scratch"),
            "hc": Buffer((B, NT, H, K, V), sdt, "scratch"),
            "vn": Buffer((B, T, H, V), sdt, "scratch"), "ht": Buffer((B, H, K, V), f32, "scratch"),
            "dhc": Buffer((B, NT, H, K, V), sdt, "scratch"),
            "dvn": Buffer((B, T, H, V), f32, "scratch"),
            "dq": Buffer((B, T, H, K), dtype, "output"),
            "dk_part": Buffer((B, T, H, K), f32, "scratch"),
            "dw": Buffer((B, T, H, K), f32, "scratch"),
            "dk": Buffer((B, T, H, K), dtype, "output"), "dv": Buffer((B, T, H, V), dtype, "output"),
            "dbeta": Buffer((B, T, H), f32, "output")}
    if gated:
        bufs["g"] = Buffer((B, T, H), f32, "input")
        bufs["dG"] = Buffer((NK, B, T, H), f32, "scratch")
        bufs["dg"] = Buffer((B, T, H), f32, "output")
    state_buffers(bufs, (B, H, K, V), has_h0=has_h0, has_dht=has_dht)
    buf = buffer_args(bufs, "dvn")

    # 1: the WY factors, keeping X
    launches = delta.wy_launch_records(B, T, H, K, V, dtype=dtype, gated=gated, prec=wy_prec)
    # 2: the walker keeps the chunk states and v' (kernels.walker.walk, fused)
    walk_cfg = delta.fused_config(K, V)
    raw_gates = gated and sum_gates_in_walk(B, T)
    g_walk = "g" if gated else None
    if gated and not raw_gates:
        launches.append(gate_cumsum(bufs, B=B, T=T, H=H, BT=BT, role="scratch"))
        g_walk = "g_cum"
    launches.append(walk_launch(
        q=None, k="k", v="u", g=g_walk, w="w", h0="h0" if has_h0 else None, o=None, ht="ht",
        gt=None, B=B, T=T, H=H, K=K, V=V, gate=1 if gated else 0, scale=1.0, cfg=walk_cfg,
        prec=prec, seg=segment_length(T, BT, 1), n=1, raw_gates=raw_gates, hc="hc", vn="vn"))
    dims = (("H", H), ("K", K), ("V", V), ("BT", BT))
    # 3: the reverse walk
    launches.append(Launch(
        "delta_dstates", (cdiv(V, cfg["walk_BV"]), B * H, 1),
        tuple((n, *buf(n)) for n in ("q", "k", "w", "g", "do", "dht", "dhc", "dvn", "dh0"))
        + (("T", "i32", T), ("NT", "i32", NT), ("scale", "fp32", scale)),
        dims + (("BK", next_pow2(K)), ("BV", cfg["walk_BV"]), ("GATE", gated),
                ("HAS_DHT", has_dht), ("STORE_DH0", has_h0), ("PREC", prec)),
        cfg["walk_warps"], cfg["walk_stages"]))
    # 4: dq, the Aq/S' parts of dk, dW, dG shares
    launches.append(Launch(
        "delta_dqk", (NT, NK, B * H),
        tuple((n, *buf(n)) for n in ("q", "k", "g", "hc", "dhc", "vn", "dvn", "do", "dq"))
        + (("dk", *buf("dk_part")), ("dw", *buf("dw")), ("dG", *buf("dG")), ("T", "i32", T),
           ("NT", "i32", NT), ("NBT", "i32", B * T), ("scale", "fp32", scale)),
        dims + (("BK", cfg["dqk_BK"]), ("BV", cfg["dqk_BV"]), ("GATE", gated), ("PREC", prec)),
        cfg["dqk_warps"], cfg["dqk_stages"]))
    # 5: the WY and Aw parts, dv, dbeta, dg
    launches.append(Launch(
        "delta_wy_bwd", (NT, B * H, 1),
        tuple((n, *buf(n)) for n in ("k", "v", "g", "beta", "xs", "dvn", "dw", "dk_part", "dG",
                                     "dk", "dv", "dbeta", "dg"))
        + (("T", "i32", T), ("NK", "i32", NK), ("NBT", "i32", B * T)),
        dims + (("BK", cfg["wy_BK"]), ("BV", cfg["wy_BV"]), ("GATE", gated),
                ("PREC", wy_prec)), cfg["wy_warps"], cfg["wy_stages"]))
    return Program(launches, bufs, "backward",
                   [f"backward: {len(launches)} launches, chunk states in {sdt}"])


def delta_rule_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor,
                        S_in: Tensor | None, do: Tensor | None, dht: Tensor | None,
                        scale: float, *, tiles: dict | None = None):
    """Gradients of ``(o, S_T)`` of the delta rule (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp16/bf16/fp32, one dtype).
        g: log decays ``[B, T, H]`` or ``None`` (DeltaNet); beta: ``[B, T, H]``.
        S_in: incoming state ``[B, H, K, V]`` or ``None``; do: ``[B, T, H, V]`` or ``None``;
        dht: gradient of the final state ``[B, H, K, V]`` or ``None``.
        tiles: overrides of :func:`default_tiles`.
    Returns:
        ``(dq, dk, dv, dg, dbeta, dS_in)``: dq, dk, dv in the dtypes of q, k, v; dg (``None``
        without ``g``) and dbeta ``[B, T, H]`` fp32; dS_in fp32 (``None`` without ``S_in``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError("q, k, v: expected q, k [B, T, H, K] and v [B, T, H, V], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if t is not None and tuple(t.shape) != (B, T, H):
            raise ValueError(f"{name}: expected shape {(B, T, H)}, got {tuple(t.shape)}")
    f32 = torch.float32
    do = torch.zeros_like(v) if do is None else do.contiguous()
    prog = backward_program(B, T, H, K, V, dtype=q.dtype, gated=g is not None,
                            has_h0=S_in is not None, has_dht=dht is not None, scale=scale,
                            prec=dot_precision(q.dtype), beta_dtype=beta.dtype,
                            do_dtype=do.dtype, tiles=tiles)
    tensors = {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(),
               "beta": beta.contiguous(), "do": do}
    if g is not None:
        tensors["g"] = g.to(f32).contiguous()
    if S_in is not None:
        tensors["h0"] = S_in.to(f32).contiguous()
    if dht is not None:
        tensors["dht"] = dht.to(f32).contiguous()
    prog.execute(tensors, q.device)
    return (tensors["dq"], tensors["dk"], tensors["dv"], tensors.get("dg"), tensors["dbeta"],
            tensors.get("dh0"))


def kernel_specs(K: int = 128, V: int = 128, *, H: int = 32, dtype=torch.bfloat16) -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of every launch of
    :func:`delta_rule_backward` at these dims with the default tiles, gated, with an incoming
    state and a final-state gradient (for AOT compilation and the resource report)."""
    return backward_program(1, 256, H, K, V, dtype=dtype, gated=True, has_h0=True,
                            has_dht=True, scale=K ** -0.5, prec="tf32x3").specs()

"""Triton backward pass of the scalar-decay matrix state (linear_attn, simple_gla).

Forward (per head, per token)::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = scale * S_t^T q_t

chunked in ``BT`` tokens.  In chunk ``c`` (start state ``h_c``, in-chunk cumulative log decay
``G_i = g_{t0} + ... + g_{t0+i}``, chunk total ``G_C``, decay mask
``M_ij = exp(G_i - G_j)`` for ``i >= j`` and 0 above the diagonal)::

    o       = scale * [ (q * e^G) h_c + (M o q k^T) v ]
    h_{c+1} = e^{G_C} h_c + (k * e^{G_C - G})^T v

Backward.  Let ``dh_c`` be the gradient of the loss w.r.t. the state at the *end* of chunk
``c`` (``dh_{NT-1} = dht``).  Then::

    dh_{c-1} = e^{G_C} dh_c + scale * (q * e^G)^T do                        (reverse walk)
    dA       = scale * M o (do v^T)                                        [BT, BT]
    dq       = scale * (do h_c^T) * e^G           + dA k
    dk       = (v dh_c^T) * e^{G_C - G}           + dA^T q
    dv       = (k dh_c) * e^{G_C - G}  + scale * (M o (q k^T))^T do

and ``dS_in`` is the reverse walk's value past the first chunk.

Gate gradient.  Treat ``G_0 .. G_{BT-1}`` and ``G_C`` of one chunk as independent variables
(``h_c`` and ``dh_c`` fixed).  Every term of ``o_i`` carries the factor ``e^{+G_i}``, every
term holding ``k_j`` carries ``e^{-G_j}``, and every term of ``h_{c+1}`` carries
``e^{+G_C}``; a linear form ``x -> <dx, x>`` scaled by ``e^{s}`` has derivative ``<dx, x>``
w.r.t. ``s``, so::

    dL/dG_i = q_i . dq_i - k_i . dk_i
    dL/dG_C = <dh_c, h_{c+1}> = e^{G_C} <dh_c, h_c> + sum_j k_j . dk_j^inter

(``dk^inter = (v dh_c^T) e^{G_C - G}``, the second form needs no ``h_{c+1}``).  With
``G_i = sum_{t <= i} g_t`` and ``G_C = sum_t g_t`` inside the chunk::

    dg_t = sum_{i >= t} (q_i . dq_i - k_i . dk_i) + dL/dG_C

That form is exact but cancels badly: the diagonal ``i = j`` intra terms
``scale (do_i . v_i)(q_i . k_i)`` are O(1) and appear in both ``q_i . dq_i`` and
``k_i . dk_i``, while at steep gates the true ``dg`` is O(e^g) (1e-9 at g = -20: fp32 rounding
of the O(1) terms gave relative errors of 6e2).  The kernel therefore expands it and drops
what cancels exactly.  With ``a_i = q_i . dq_i^inter``, ``b_j = k_j . dk_j^inter``,
``c = e^{G_C} <dh_c, h_c>`` and ``W_ij = scale M_ij (do_i . v_j)(q_i . k_j)`` (``i > j``)::

    dg_t = sum_{i >= t} a_i + sum_{j < t} b_j + c + sum_{j < t <= i} W_ij

(the intra terms are exactly the pairs whose decay ``exp(G_i - G_j)`` contains ``g_t``).  Every
term carries its own decay, so nothing large cancels.  The last sum is a reverse cumulative
sum over ``i`` of ``W`` followed by a masked row sum, ``O(BT^2)`` work next to ``O(BT^2 K)``
of the dots.  Everything is chunk-local: ``dg`` comes out of the chunk-parallel kernel with
no pass over the sequence.  All exponents are non-positive differences (``G_i - G_j`` is
masked to ``-inf`` for ``i < j`` before the exponential; ``G_i``, ``G_C - G_j`` and ``G_C`` are
sums of log decays), so gates of -20 per token underflow to 0 instead of overflowing.

Kernels (three or four launches):

1. ``_fwd_states_kernel`` -- re-walks the chunks and stores every chunk-start state
   ``h [B, NT, H, K, V]``.  The forward walker keeps its state on chip and does not store
   these; recomputing costs one read of k and v, cheaper than making every forward keep
   ``NT`` states alive.  The recurrence is separable in K and V, so the grid is
   ``(K tiles, V tiles, B * H)``; the tiles shrink (to 32) until there are 1.5 programs per
   SM (B=1, H=32, K=V=128 on 132 SMs: 32x64 tiles, 256 programs).
2. ``_bwd_states_kernel`` -- the reverse walk for ``dh [B, NT, H, K, V]`` from ``dht`` and
   ``dS_in`` at its end; same grid.  Both walks also serve the vector-decay backward
   (``GATE=2``, per-channel gates; see vector_backward.py).
3. ``_dqkg_kernel`` -- chunk-parallel, grid ``(NT, K tiles, B * H)``; loops over V tiles,
   computes ``dq``, ``dk`` and the chunk-local ``dg`` (summed over K tiles when ``K > 128``).
   With one K tile (``K <= 128``) it also computes ``dv`` inside its V loop (``FUSE_DV``).
4. ``_dv_kernel`` -- only when ``K > 128``: chunk-parallel, grid ``(NT, V tiles, B * H)``,
   loops over K tiles.

At B=1, H=32, T=32K the chunk-parallel kernels run 16K programs each; only the two walks
are sequential over chunks.  ``h`` and ``dh`` are stored in the input dtype for 16-bit
inputs (the dots consume them in that dtype anyway) and in fp32 for fp32 inputs; every
accumulation is fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, dot_precision, next_pow2, tl, triton
from .ir import Buffer, Launch, Program, buffer_args, state_buffers
from .tiles import reset_floor, scalar_gate_chunk, value_state_tiles
from . import sm_count, summed_gate_grad

__all__ = ["kernel_specs", "scalar_decay_backward"]


if HAVE_TRITON:

    @triton.jit
    def vector_gate_chunk_t(g, bos, t0, T, i_h, i_k, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr):
        """Per-channel gates of one chunk and K tile, transposed (``[BK, BT]``), from
        ``g [B, T, H, K]``: the in-chunk cumulative log decay ``G``, the decay after each
        token ``r = G_C - G`` and the chunk total ``G_C [BK]`` (padding reads 0).

        ``r`` is the reverse cumulative sum minus the token's own gate (all terms one sign),
        not ``G_C - G``: its absolute error follows ``|g_t| + |r_t|`` instead of ``|G_C|``,
        which matters at steep gates where ``G_C`` is hundreds.
        """
        p_gt = tl.make_block_ptr(g + (bos * H + i_h) * K, (K, T), (1, H * K),
                                 (i_k * BK, t0), (BK, BT), (0, 1))
        b_gt = reset_floor(tl.load(p_gt, boundary_check=(0, 1)).to(tl.float32))
        b_rt = tl.cumsum(b_gt, axis=1, reverse=True) - b_gt
        return tl.cumsum(b_gt, axis=1), b_rt, tl.sum(b_gt, axis=1)

    @triton.jit
    def _fwd_states_kernel(k, v, g, h0, h, T, NT, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr,
                           PREC: tl.constexpr):
        """Chunk-start states: ``h[b, c, h] = S`` before chunk ``c``; grid (NK, NV, B*H).

        ``GATE``: 0 none, 1 scalar ``g [B, T, H]``, 2 per key channel ``g [B, T, H, K]``
        (gla, see vector_backward.py)."""
        i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        DT = k.dtype.element_ty
        if HAS_H0:
            p0 = tl.make_block_ptr(h0 + (i_b * H + i_h) * K * V, (K, V), (V, 1),
                                   (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            b_S = tl.load(p0, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_S = tl.zeros([BK, BV], dtype=tl.float32)
        for c in range(NT):
            t0 = c * BT
            p_h = tl.make_block_ptr(h + ((i_b * NT + c) * H + i_h) * K * V, (K, V), (V, 1),
                                    (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            tl.store(p_h, b_S.to(p_h.dtype.element_ty), boundary_check=(0, 1))
            # k^T [BK, BT] straight from memory, v [BT, BV]
            p_kt = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T), (1, H * K),
                                     (i_k * BK, t0), (BK, BT), (0, 1))
            p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                    (t0, i_v * BV), (BT, BV), (1, 0))
            b_kt = tl.load(p_kt, boundary_check=(0, 1))
            b_v = tl.load(p_v, boundary_check=(0, 1)).to(DT)
            if GATE == 1:
                b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
                b_kt = (b_kt.to(tl.float32) * tl.exp(b_GC - b_G)[None, :]).to(DT)
                b_S = b_S * tl.exp(b_GC)
            elif GATE == 2:
                _, b_rt, b_GC = vector_gate_chunk_t(g, bos, t0, T, i_h, i_k, H, K, BT, BK)
                b_kt = (b_kt.to(tl.float32) * tl.exp(b_rt)).to(DT)
                b_S = b_S * tl.exp(b_GC)[:, None]
            b_S += tl.dot(b_kt, b_v, input_precision=PREC)

    @triton.jit
    def _bwd_states_kernel(q, g, do, dht, dh, dh0, T, NT, scale, H: tl.constexpr,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                           HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                           PREC: tl.constexpr, STORE_STATES: tl.constexpr = True):
        """Reverse walk: ``dh[b, c, h]`` = gradient w.r.t. the state after chunk ``c``;
        ``dh0`` the gradient w.r.t. the incoming state.  Grid (NK, NV, B*H); ``GATE`` as in
        ``_fwd_states_kernel``.  ``STORE_STATES=False``: ``dh0`` only (a sequence-parallel
        rank's state gradient before its backward, ``kernels.state_grad_program``)."""
        i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        DT = q.dtype.element_ty
        if HAS_DHT:
            p_t = tl.make_block_ptr(dht + (i_b * H + i_h) * K * V, (K, V), (V, 1),
                                    (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            b_dS = tl.load(p_t, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_dS = tl.zeros([BK, BV], dtype=tl.float32)
        for i in range(NT):
            c = NT - 1 - i
            t0 = c * BT
            p_dh = tl.make_block_ptr(dh + ((i_b * NT + c) * H + i_h) * K * V, (K, V), (V, 1),
                                     (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            if STORE_STATES:
                tl.store(p_dh, b_dS.to(p_dh.dtype.element_ty), boundary_check=(0, 1))
            p_qt = tl.make_block_ptr(q + (bos * H + i_h) * K, (K, T), (1, H * K),
                                     (i_k * BK, t0), (BK, BT), (0, 1))
            p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                     (t0, i_v * BV), (BT, BV), (1, 0))
            b_qt = tl.load(p_qt, boundary_check=(0, 1))
            b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
            if GATE == 1:
                b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
                b_qt = (b_qt.to(tl.float32) * tl.exp(b_G)[None, :]).to(DT)
                b_dS = b_dS * tl.exp(b_GC)
            elif GATE == 2:
                b_Gt, _, b_GC = vector_gate_chunk_t(g, bos, t0, T, i_h, i_k, H, K, BT, BK)
                b_qt = (b_qt.to(tl.float32) * tl.exp(b_Gt)).to(DT)
                b_dS = b_dS * tl.exp(b_GC)[:, None]
            b_dS += tl.dot(b_qt, b_do, input_precision=PREC) * scale
        if STORE_DH0:
            p_0 = tl.make_block_ptr(dh0 + (i_b * H + i_h) * K * V, (K, V), (V, 1),
                                    (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            tl.store(p_0, b_dS, boundary_check=(0, 1))

    @triton.jit
    def _dv_kernel(q, k, g, do, dh, dv, T, NT, scale, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, PREC: tl.constexpr):
        """``dv = (k dh_c) e^{G_C - G} + scale (M o q k^T)^T do``; grid (NT, NV, B*H)."""
        i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # chunks on axis 0
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        DT = k.dtype.element_ty
        b_At = tl.zeros([BT, BT], dtype=tl.float32)  # At[j, i] = k_j . q_i
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                    (t0, i_k * BK), (BT, BK), (1, 0))
            p_qt = tl.make_block_ptr(q + (bos * H + i_h) * K, (K, T), (1, H * K),
                                     (i_k * BK, t0), (BK, BT), (0, 1))
            p_dh = tl.make_block_ptr(dh + ((i_b * NT + i_t) * H + i_h) * K * V, (K, V), (V, 1),
                                     (i_k * BK, i_v * BV), (BK, BV), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_qt = tl.load(p_qt, boundary_check=(0, 1))
            b_dh = tl.load(p_dh, boundary_check=(0, 1)).to(DT)
            b_At += tl.dot(b_k, b_qt, input_precision=PREC)
            b_dv += tl.dot(b_k, b_dh, input_precision=PREC)
        rows = tl.arange(0, BT)
        upper = rows[:, None] <= rows[None, :]  # j <= i in At[j, i]
        if GATE:
            b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_At = b_At * tl.exp(tl.where(upper, b_G[None, :] - b_G[:, None], float("-inf")))
            b_dv = b_dv * tl.exp(b_GC - b_G)[:, None]
        else:
            b_At = tl.where(upper, b_At, 0.0)
        p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                 (t0, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
        b_dv += tl.dot((b_At * scale).to(DT), b_do, input_precision=PREC)
        p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                 (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))

    @triton.jit
    def _dqkg_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, T, NT, NBT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                     FUSE_DV: tl.constexpr, PREC: tl.constexpr):
        """``dq``, ``dk`` of one K tile and that tile's share of the chunk-local ``dg``
        (``dg [NK, B, T, H]``, summed over K tiles by the caller); grid (NT, NK, B*H).

        ``FUSE_DV`` (one K tile covers K): also ``dv``, tile by tile inside the V loop, which
        saves the dv kernel's second read of q, k, do and dh.
        """
        # chunks on axis 0: CUDA caps axes 1 and 2 at 65535 blocks (T = 4M at BT = 64)
        i_t, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        DT = k.dtype.element_ty
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                (t0, i_k * BK), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                (t0, i_k * BK), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]
        if GATE:
            b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_M = tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
            b_kdecay = tl.exp(b_GC - b_G)  # e^{G_C - G_j}
        if GATE or FUSE_DV:
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # q_i . k_j (this K tile)
        if FUSE_DV:
            if GATE:
                b_At = tl.trans(b_A * b_M * scale).to(DT)
            else:
                b_At = tl.trans(tl.where(causal, b_A, 0.0) * scale).to(DT)

        b_dA = tl.zeros([BT, BT], dtype=tl.float32)  # dA[i, j] = do_i . v_j
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)  # rows of <h_c, dh_c>
        base_h = ((i_b * NT + i_t) * H + i_h) * K * V
        for i_v in range(tl.cdiv(V, BV)):
            b_v, b_do, b_ht, b_dht = value_state_tiles(v, do, h, dh, bos, i_h, t0, i_v, i_k,
                                                       base_h, T, H, K, V, BT, BK, BV)
            b_v, b_do = b_v.to(DT), b_do.to(DT)
            b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
            b_dq += tl.dot(b_do, b_ht.to(DT), input_precision=PREC)
            b_dk += tl.dot(b_v, b_dht.to(DT), input_precision=PREC)
            if GATE:
                b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
            if FUSE_DV:
                b_dv = tl.dot(b_k, tl.trans(b_dht).to(DT), input_precision=PREC)
                if GATE:
                    b_dv = b_dv * b_kdecay[:, None]
                b_dv += tl.dot(b_At, b_do, input_precision=PREC)
                p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                         (t0, i_v * BV), (BT, BV), (1, 0))
                tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))

        if GATE:
            b_dA = b_dA * b_M * scale
            b_dq = b_dq * (tl.exp(b_G) * scale)[:, None]  # inter-chunk parts only, so far
            b_dk = b_dk * b_kdecay[:, None]
            # gate gradient, straddling form (module docstring): this K tile's share of
            #   dg_t = sum_{i>=t} a_i + sum_{j<t} b_j + c + sum_{j<t<=i} W_ij
            b_a = tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
            b_b = tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
            b_c = tl.exp(b_GC) * tl.sum(b_hdh, axis=0)
            b_R = tl.cumsum(b_dA * b_A, axis=0, reverse=True)  # R[t, j] = sum_{i>=t} W[i, j]
            before = rows[None, :] < rows[:, None]  # j < t
            b_dg = (tl.sum(tl.where(before, b_R + b_b[None, :], 0.0), axis=1)
                    + tl.cumsum(b_a, axis=0, reverse=True) + b_c)
            o_t = t0 + rows
            tl.store(dg + (i_k * NBT + bos + o_t) * H + i_h, b_dg, mask=o_t < T)
        else:
            b_dA = tl.where(causal, b_dA, 0.0) * scale
            b_dq = b_dq * scale
        b_dA = b_dA.to(DT)
        b_dq += tl.dot(b_dA, b_k, input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_dA), b_q, input_precision=PREC)
        p_dq = tl.make_block_ptr(dq + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                 (t0, i_k * BK), (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                 (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))


def default_tiles(B: int, H: int, K: int, V: int, device: torch.device | int) -> dict:
    """Tile sizes per kernel (see the module docstring for the reasoning); ``device``: the
    device or its SM count.

    ``walk_BK/walk_BV``: state tile of the two sequential walks, shrunk (64 -> 32, K first)
    until there are 1.5 programs per SM.  ``dv_BV``/``dv_BK``: output tile / K loop tile of the
    dv kernel.  ``dqk_BK``/``dqk_BV``: output tile / V loop tile of the dq, dk, dg kernel
    (one K tile up to K = 128, so dg needs no cross-tile sum there).
    """
    PK, PV = next_pow2(K), next_pow2(V)
    BK, BV = min(64, PK), min(64, PV)
    target = 3 * sm_count(device) // 2
    while B * H * cdiv(K, BK) * cdiv(V, BV) < target and max(BK, BV) > 32:
        if BK >= BV:
            BK //= 2
        else:
            BV //= 2
    dqk_BK, dqk_BV = min(128, PK), min(32, PV)
    # 8 warps not with a 16-wide V tile: the delta rule's 8-warp kernels with one made
    # illegal memory accesses (Triton 3.6, sm_90; results/logs/delta_bwd_small_dims_*_s28.log)
    return {"walk_BK": BK, "walk_BV": BV, "walk_warps": 4, "walk_stages": 3,
            "dv_BV": min(64, PV), "dv_BK": min(64, PK), "dv_warps": 4, "dv_stages": 2,
            "dqk_BK": dqk_BK, "dqk_BV": dqk_BV,
            "dqk_warps": 8 if dqk_BK >= 128 and dqk_BV >= 32 else 4,
            "dqk_stages": 3, "fuse_dv": True}


def state_walks(buf, *, B: int, T: int, H: int, K: int, V: int, BT: int, gate: int,
                has_h0: bool, has_dht: bool, scale: float, prec: str, cfg: dict) -> list:
    """The two walks of a backward program as launches: every chunk-start state ``h`` from
    ``h0``, then the reverse walk for ``dh`` (and ``dh0``); ``gate`` 0 / 1 (this pattern)
    or 2 (per-channel gates, :mod:`.vector_backward`); ``buf(name)`` gives a pointer
    argument (:func:`forge_dist.kernels.ir.buffer_args`); tiles from ``cfg``."""
    NT = cdiv(T, BT)
    wBK, wBV = cfg["walk_BK"], cfg["walk_BV"]
    grid = (cdiv(K, wBK), cdiv(V, wBV), B * H)
    const = (("H", H), ("K", K), ("V", V), ("BT", BT), ("BK", wBK), ("BV", wBV),
             ("GATE", gate))
    return [
        Launch("chunk_states", grid,
               (("k", *buf("k")), ("v", *buf("v")), ("g", *buf("g")), ("h0", *buf("h0")),
                ("h", *buf("h")), ("T", "i32", T), ("NT", "i32", NT)),
               const + (("HAS_H0", has_h0), ("PREC", prec)),
               cfg["walk_warps"], cfg["walk_stages"]),
        Launch("chunk_states_bwd", grid,
               (("q", *buf("q")), ("g", *buf("g")), ("do", *buf("do")), ("dht", *buf("dht")),
                ("dh", *buf("dh")), ("dh0", *buf("dh0")), ("T", "i32", T), ("NT", "i32", NT),
                ("scale", "fp32", float(scale))),
               const + (("HAS_DHT", has_dht), ("STORE_DH0", has_h0), ("PREC", prec)),
               cfg["walk_warps"], cfg["walk_stages"])]


def backward_program(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype,
                     gated: bool, has_h0: bool, has_dht: bool, scale: float, prec: str,
                     BT: int = 64, tiles: dict | None = None,
                     state_dtype: torch.dtype | None = None, sms: int = 132,
                     do_dtype: torch.dtype | None = None):
    """The launches of :func:`scalar_decay_backward` as a
    :class:`~forge_dist.kernels.ir.Program` (one source for the function, the plans'
    backward and the AOT cache).

    Buffers: inputs ``q, k [B, T, H, K]``, ``v`` and ``do [B, T, H, V]`` (``dtype``), ``g``
    fp32 ``[B, T, H]`` (``gated``), ``h0`` and ``dht`` fp32 ``[B, H, K, V]`` (``has_h0``,
    ``has_dht``); outputs ``dq, dk, dv`` (``dtype``), ``dg_part`` fp32 ``[NK, B, T, H]``
    (``gated``; the K tiles' shares, summed by the caller when ``NK > 1``) and ``dh0`` fp32
    (``has_h0``); scratch ``h, dh [B, NT, H, K, V]`` (``state_dtype``, default fp32 for fp32
    inputs, else ``dtype``).  ``sms``: the SM count the walk tiles are sized for;
    ``do_dtype``: of ``do`` when it differs from ``dtype``.
    """
    cfg = default_tiles(B, H, K, V, sms)
    if tiles:
        cfg.update(tiles)
    NT = cdiv(T, BT)
    sdt = state_dtype or (torch.float32 if dtype == torch.float32 else dtype)
    f32 = torch.float32
    NKq = cdiv(K, cfg["dqk_BK"])
    bufs = {"q": Buffer((B, T, H, K), dtype, "input"), "k": Buffer((B, T, H, K), dtype, "input"),
            "v": Buffer((B, T, H, V), dtype, "input"),
            "do": Buffer((B, T, H, V), do_dtype or dtype, "input"),
            "dq": Buffer((B, T, H, K), dtype, "output"),
            "dk": Buffer((B, T, H, K), dtype, "output"),
            "dv": Buffer((B, T, H, V), dtype, "output"),
            "h": Buffer((B, NT, H, K, V), sdt, "scratch"),
            "dh": Buffer((B, NT, H, K, V), sdt, "scratch")}
    if gated:
        bufs["g"] = Buffer((B, T, H), f32, "input")
        bufs["dg_part"] = Buffer((NKq, B, T, H), f32, "output")
    state_buffers(bufs, (B, H, K, V), has_h0=has_h0, has_dht=has_dht)
    buf = buffer_args(bufs, "h")
    dims = (("H", H), ("K", K), ("V", V), ("BT", BT))
    launches = state_walks(buf, B=B, T=T, H=H, K=K, V=V, BT=BT, gate=int(gated),
                           has_h0=has_h0, has_dht=has_dht, scale=scale, prec=prec, cfg=cfg)
    fuse = cfg["fuse_dv"] and NKq == 1
    if not fuse:
        launches.append(Launch(
            "scalar_dv", (NT, cdiv(V, cfg["dv_BV"]), B * H),
            (("q", *buf("q")), ("k", *buf("k")), ("g", *buf("g")), ("do", *buf("do")),
             ("dh", *buf("dh")), ("dv", *buf("dv")), ("T", "i32", T), ("NT", "i32", NT),
             ("scale", "fp32", float(scale))),
            dims + (("BK", cfg["dv_BK"]), ("BV", cfg["dv_BV"]), ("GATE", gated),
                    ("PREC", prec)), cfg["dv_warps"], cfg["dv_stages"]))
    launches.append(Launch(
        "scalar_dqkg", (NT, NKq, B * H),
        tuple((n, *buf(n)) for n in ("q", "k", "v", "g", "h", "do", "dh", "dq", "dk", "dv"))
        + (("dg", *buf("dg_part")), ("T", "i32", T), ("NT", "i32", NT), ("NBT", "i32", B * T),
           ("scale", "fp32", float(scale))),
        dims + (("BK", cfg["dqk_BK"]), ("BV", cfg["dqk_BV"]), ("GATE", gated),
                ("FUSE_DV", fuse), ("PREC", prec)), cfg["dqk_warps"], cfg["dqk_stages"]))
    return Program(launches, bufs, "backward",
                   [f"backward: {len(launches)} launches, chunk states in {sdt}"])


def scalar_decay_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
                          S_in: Tensor | None, do: Tensor | None, dht: Tensor | None,
                          scale: float, *, BT: int = 64, tiles: dict | None = None,
                          state_dtype: torch.dtype | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of ``(o, S_T)`` of the scalar-decay recurrence (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp16/bf16/fp32, one dtype).
        g: per-token natural-log decays ``[B, T, H]`` (simple_gla) or ``None`` (linear_attn).
        S_in: incoming state ``[B, H, K, V]`` or ``None`` (zeros).
        do: gradient of ``o`` ``[B, T, H, V]`` (any float dtype) or ``None`` (zeros).
        dht: gradient of the final state ``[B, H, K, V]`` or ``None`` (zeros).
        scale: the query scale of the forward.
        BT: chunk length (tokens).
        tiles: overrides of :func:`default_tiles` (tests use it to force several tiles).
        state_dtype: dtype of the stored chunk states ``h`` and ``dh`` (default: fp32 for
            fp32 inputs, the input dtype otherwise).
    Returns:
        ``(dq, dk, dv, dg, dS_in)``: dq, dk, dv in the dtypes of q, k, v; dg ``[B, T, H]``
        fp32 (``None`` without ``g``); dS_in ``[B, H, K, V]`` fp32 (``None`` without ``S_in``).
    """
    if not HAVE_TRITON:
        raise RuntimeError("scalar_decay_backward needs triton")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or (g is not None
                                                           and g.shape != q.shape[:3]):
        raise ValueError("expected q, k [B, T, H, K], v [B, T, H, V], g [B, T, H]")
    do = torch.zeros_like(v) if do is None else do.contiguous()
    prog = backward_program(B, T, H, K, V, dtype=q.dtype, gated=g is not None,
                            has_h0=S_in is not None, has_dht=dht is not None, scale=scale,
                            prec=dot_precision(q.dtype), BT=BT, tiles=tiles,
                            state_dtype=state_dtype, sms=sm_count(q.device),
                            do_dtype=do.dtype)
    tensors = {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "do": do}
    if g is not None:
        tensors["g"] = g.to(torch.float32).contiguous()
    if S_in is not None:
        tensors["h0"] = S_in.to(torch.float32).contiguous()
    if dht is not None:
        tensors["dht"] = dht.to(torch.float32).contiguous()
    prog.execute(tensors, q.device)
    dg = summed_gate_grad(tensors["dg_part"]) if g is not None else None
    return tensors["dq"], tensors["dk"], tensors["dv"], dg, tensors.get("dh0")


def kernel_specs(K: int = 128, V: int = 128, dtype: torch.dtype = torch.bfloat16, *,
                 B: int = 1, H: int = 32, gate: bool = True, BT: int = 64) -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of every launch of
    :func:`scalar_decay_backward` at these dims with the default tiles (sized for a nominal
    132-SM H100/H200), with an incoming state and a final-state gradient, for AOT
    compilation and the resource report."""
    return backward_program(B, 256, H, K, V, dtype=dtype, gated=gate, has_h0=True,
                            has_dht=True, scale=K ** -0.5, prec="tf32x3", BT=BT).specs()

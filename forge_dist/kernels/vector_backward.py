"""Triton backward pass of the vector-decay matrix state (gla).

Forward (per batch, head and token; ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``g`` the
natural-log decay per token and key channel, ``<= 0``)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T        (S [K, V], fp32)
    o_t = scale * S_t^T q_t

chunked in ``BT`` tokens.  In chunk ``c`` (start state ``h_c``; per key channel the in-chunk
cumulative log decay ``G_i = g_{t0} + ... + g_{t0+i}`` [K], the chunk total ``G_C`` [K] and
the decay after token ``j``, ``r_j = G_C - G_j = g_{j+1} + ... + g_{BT-1}``)::

    A_ij    = sum_k q_ik k_jk exp(G_ik - G_jk)                 (j <= i, else 0)
    o_i     = scale * [ (q_i * e^{G_i})^T h_c + sum_j A_ij v_j ]
    h_{c+1} = diag(e^{G_C}) h_c + sum_j (k_j * e^{r_j}) v_j^T

Backward.  ``dh_c`` is the gradient w.r.t. the state at the *end* of chunk ``c``
(``dh_{NT-1} = dht``)::

    dh_{c-1} = diag(e^{G_C}) dh_c + scale * sum_i (q_i * e^{G_i}) do_i^T        (reverse walk)
    dA_ij    = scale * do_i . v_j                                  (j <= i)       [BT, BT]
    dq_i     = scale * (h_c do_i) * e^{G_i}      + sum_{j<=i} dA_ij k_j * e^{G_i - G_j}
    dk_j     = (dh_c v_j) * e^{r_j}              + sum_{i>=j} dA_ij q_i * e^{G_i - G_j}
    dv_j     = dh_c^T (k_j * e^{r_j})            + scale * sum_{i>=j} A_ij do_i

(products ``*`` elementwise over K), and ``dS_in`` is the reverse walk's value past the first
chunk.  Shapes: ``h, dh [B, NT, H, K, V]``; ``dq, dk, dg [B, T, H, K]``; ``dv [B, T, H, V]``.

Gate gradient, per key channel ``k`` (the scalar derivation of scalar_backward.py, channel by
channel).  Treat ``G_{i,k}`` and ``G_{C,k}`` of one chunk as independent (``h_c``, ``dh_c``
fixed): every term holding ``q_ik`` carries ``e^{+G_ik}``, every term holding ``k_jk`` carries
``e^{-G_jk}``, every row ``k`` of ``h_{c+1}`` carries ``e^{+G_Ck}``, so::

    dL/dG_ik  = q_ik dq_ik - k_ik dk_ik                           (full dq, dk)
    dL/dG_Ck  = e^{G_Ck} sum_v h_c[k, v] dh_c[k, v] + sum_j k_jk dk_jk^inter
    dg_tk     = sum_{i>=t} dL/dG_ik + dL/dG_Ck                                        (1)

(``dk^inter = (dh_c v) * e^r``, the first part of ``dk``).  Form (1) cancels at steep gates:
the diagonal ``i = j`` intra terms ``dA_ii q_ik k_ik`` are O(1) in both ``q.dq`` and
``k.dk``, while the true ``dg`` is O(e^g).  Expanded, the exactly cancelling pairs dropped::

    dg_tk = sum_{i>=t} a_ik + sum_{j<t} b_jk + c_k + sum_{j<t<=i} W_ijk                (2)
    a_ik  = q_ik dq_ik^inter,   b_jk = k_jk dk_jk^inter,   c_k = e^{G_Ck} <h_c[k], dh_c[k]>,
    W_ijk = dA_ij q_ik k_jk e^{G_ik - G_jk}

(the intra terms are exactly the pairs whose decay contains ``g_t``).  Every term carries its
own decay, so (2) is cancellation-free: what cancels in it is only the genuine sign mixing
of the terms of ``dg`` itself (fp32, gates of -20..-34 per token on three of four channels,
tests/kernels/test_vector_backward.py: relative error of ``dg`` 4e-7 on the steep channels,
1.4e-6 on the worst one, where (1) in the same arithmetic, even from exact ``dq`` and ``dk``,
is off by a factor of ~700).  But ``W`` is ``[BT, BT, K]``:
(2) costs ``O(BT^2 K)`` elementwise work per chunk, one key column at a time, which made the
backward slow.  Hence two paths, chosen per chunk and slice of ``BKS`` channels.

Fast path (realistic gates).  The slice's *span*, the largest ``sum_t |g_tk|`` over the
chunk in one of its channels (``-G_C`` for decays), bounds ``|G|``.  When it is at most
``vector.span_max(dtype)`` (60; 8 for fp16 operands) a single reference point per chunk is
safe, ``q e^G <= |q|`` and ``k e^{-G} <= |k| e^{span}`` (finite in the operand dtype, and
``e^{60} K |q k|`` is far below fp32's range), and every intra-chunk term is a tensor-core
product of such factors, with the masks applied to ``dA`` before the products and to ``A``
after (the ``i < j`` entries are the only large ones)::

    qg = q e^G,  ki = k e^{-G},  A = tril(qg ki^T)
    dq = (scale do h_c^T + dA ki) e^G,     dk = (v dh_c^T e^{G_C} + dA^T qg) e^{-G}

and ``dg`` takes form (1): a reverse cumulative sum of ``q dq - k dk`` per channel plus
``dL/dG_C`` on every token.  A product's rounding error is relative to the magnitudes of its
terms, each a decay times O(1) factors, so ``dq``, ``dk`` and ``A`` keep the accuracy of
their operands; ``dg`` carries the O(eps) absolute error of (1), which matters only next to
a true ``dg`` of O(e^g) (say one gate of -50 in an otherwise mild chunk).  FLA computes
``dg`` this way too.

Exact path (steep gates).  Form (2) with the column loop, on blocks of ``BC = 32`` tokens
(``BT / 2`` at ``BT = 64``, else the chunk), each with the states at its own start and end:
block 0 of a 64-token chunk ends with ``dh_m = e^{G_C1} dh_c + scale (q_1 e^{G_1})^T do_1``,
block 1 starts from ``h_m = e^{G_C0} h_c + (k_0 e^{r_0})^T v_0`` (``G_1``, ``r_0`` measured
from the boundary between them, so every factor is a decay <= 1).  The kernel never builds
``h_m`` or ``dh_m``: their products with ``do``, ``v`` and each other follow from those with
``h_c``, ``dh_c`` and ``do_1 v_0^T`` (``_exact_chunk_block``).  The A across the blocks is
one product with the boundary as reference.  So the exact path keeps the 32-token column
loop, ``O(32 K)`` per token.  Every exponent there is a non-positive sum of log decays: the
intra decay ``G_i - G_j`` is summed directly, ``sum_{j<s<=i} g_s`` (a cumulative sum of the
gates masked to ``s > j``, the ``i < j`` entries masked to ``-inf`` before the exponential),
exact to a few ulps of itself instead of ulps of ``G_i`` (hundreds at gates of -20 per
token); ``r_j`` is a reverse cumulative sum less the own gate (terms of one sign).

Chunk length.  ``BT = 64`` by default: the stored states ``h`` and ``dh``, the dominant
memory traffic (written by the walks, read by the chunk kernels), cost ``O(1 / BT)`` per
token, half of ``BT = 32``'s, and the fast path's products are 64-row tensor-core tiles; the
exact path keeps its cost per token through the 32-token blocks.  ``BT = 32`` and ``16``
remain (one block per chunk).

Kernels (five launches, four with one K tile):

1. ``_fwd_states_kernel`` (scalar_backward.py, ``GATE=2``) -- chunk-start states ``h``.
2. ``_bwd_states_kernel`` (same, ``GATE=2``) -- the reverse walk for ``dh`` and ``dS_in``.
3. ``_dqkg_kernel`` -- fast path, grid ``(NT, K tiles, B * H)``: ``dA`` from a V loop, then
   per ``BKS``-channel slice the span test and, on the fast path, the inter products (a V
   loop over the ``h``, ``dh`` tiles), ``dq``, ``dk``, ``dg`` and the slice's share of
   ``A``.  A slice over the limit is left to kernel 4, recorded in ``flags``
   ``[NT, NK, B*H]`` int32 (bit ``s``: slice ``s``).  With every slice done and one K tile
   (``K <= 128``) ``A`` is complete and ``dv`` follows (``FUSE_DV``); with several K tiles
   the tile's ``A`` goes to ``a [NK, B, T, H, BT]`` fp32.
4. ``_dqkg_exact_kernel`` -- exact path, grid ``(cdiv(NT, CH), K tiles, B * H)``: reads the
   flags ``EXACT_BF`` chunks at a time and runs the slices they name, block by block, then
   those chunks' ``dv`` (or ``A``).  Its own kernel so that its registers do not weigh on
   kernel 3.  ``CH`` chunks per program, sized to about 8 programs per SM: with mild gates
   the kernel only reads the flags (a program per chunk, one CTA per SM at 255 registers,
   would cost ~500 waves of launches at T = 64K).
5. ``_dv_kernel`` -- only with several K tiles: grid ``(NT, V tiles, B * H)``, sums the ``A``
   partials and loops over K tiles for ``dh_c^T (k * e^r)``.

Compiled for sm_90 (``kernel_specs``, Triton 3.6, ptxas -v), default tiles, bf16, K = V =
128, registers / shared memory per block: 128 / 24 KB each walk, 254 / 52 KB kernel 3
(8 warps), 255 / 20 KB kernel 4; at K = V = 256: 254 and 168 / 48 KB the walks, 251 / 40
KB kernel 3, 255 / 18 KB kernel 4, 168 / 48 KB dv.  No spills but kernel 4's ~190 bytes,
all outside its column loop (no local loads or stores in that loop's SASS): the rare path,
nested in its chunk loops.  (Before, at ``BT = 32``: 92-96 / 12 KB walks, 255 / 28 KB for
the column-loop dq/dk/dg kernel.)  fp32 inputs (3xTF32 dots) spill ~370 bytes in kernel 3
and ~400 in kernel 4 at ``BT = 64``; ``BT = 32`` spills none in kernel 3.

``h`` and ``dh`` are stored in the input dtype for 16-bit inputs (the dots consume them in that
dtype anyway) and in fp32 for fp32 inputs; every accumulation is fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import vector
from .compat import HAVE_TRITON, cdiv, dot_precision, next_pow2, tl, triton
from .ir import Buffer, Launch, Program, buffer_args, state_buffers
from . import sm_count
from .scalar_backward import state_walks
from .tiles import reset_floor

__all__ = ["default_tiles", "kernel_specs", "vector_decay_backward"]

CHUNK = 64  # default BT (module docstring: stored states cost O(1/BT) per token)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs tiles of 16 and more
EXACT_BF = 16  # chunks whose flags the exact kernel reads at once


if HAVE_TRITON:

    @triton.jit
    def _tile(r0, n_r, s_r, c0, n_c, s_c, BR: tl.constexpr, BC: tl.constexpr):
        """Offsets and mask of the ``[BR, BC]`` tile at rows ``r0..``, columns ``c0..`` of an
        ``[n_r, n_c]`` view with strides ``(s_r, s_c)``: int32, small (the callers' base
        pointers hold the large part of every offset, in int64)."""
        r = r0 + tl.arange(0, BR)
        c = c0 + tl.arange(0, BC)
        return r[:, None] * s_r + c[None, :] * s_c, (r < n_r)[:, None] & (c < n_c)[None, :]

    @triton.jit
    def _inter_parts(p_v, p_do, p_h, p_dh, n_t, c0, H: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
                     PREC: tl.constexpr):
        """The inter-chunk products of the ``BKS`` channels from ``c0``: ``do h_c^T`` and
        ``v dh_c^T`` ``[BT, BKS]``, and ``<h_c, dh_c>`` per channel ``[BKS]``, fp32, looping
        over V tiles (``p_v, p_do``: the chunk's first token; ``p_h, p_dh``: its ``[K, V]``
        states; ``n_t``: tokens left in the sequence)."""
        DT = p_v.dtype.element_ty
        b_dq = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dk = tl.zeros([BT, BKS], dtype=tl.float32)
        b_hdh = tl.zeros([BKS], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            ot, mt = _tile(0, n_t, H * V, i_v * BV, V, 1, BT, BV)
            b_v = tl.load(p_v + ot, mask=mt, other=0.0).to(DT)
            b_do = tl.load(p_do + ot, mask=mt, other=0.0).to(DT)
            os, ms = _tile(i_v * BV, V, 1, c0, K, V, BV, BKS)  # h_c^T [BV, BKS]
            b_ht = tl.load(p_h + os, mask=ms, other=0.0)
            b_dht = tl.load(p_dh + os, mask=ms, other=0.0)
            b_dq += tl.dot(b_do, b_ht.to(DT), input_precision=PREC)
            b_dk += tl.dot(b_v, b_dht.to(DT), input_precision=PREC)
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
        return b_dq, b_dk, b_hdh

    @triton.jit
    def _slice_fast(p_q, p_k, p_g, p_v, p_do, p_h, p_dh, p_dq, p_dk, p_dg, b_dA, n_t, c0,
                    scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        """dq, dk, dg of the ``BKS`` channels from ``c0`` when their decay span is at most
        the limit (module docstring, fast path: one reference point per chunk, every
        intra-chunk term one tensor-core product); returns their share of ``A``
        ``[BT, BT]`` fp32 (above the diagonal: anything).  ``p_*``: the chunk's first token
        (states: its ``[K, V]`` matrices); ``b_dA``: scale tril(do v^T), operand dtype."""
        DT = p_k.dtype.element_ty
        rows = tl.arange(0, BT)
        b_dq, b_dk, b_hdh = _inter_parts(p_v, p_do, p_h, p_dh, n_t, c0, H, K, V, BT, BKS, BV,
                                         PREC)
        ot, mt = _tile(0, n_t, H * K, c0, K, 1, BT, BKS)
        b_G = tl.cumsum(reset_floor(tl.load(p_g + ot, mask=mt, other=0.0).to(tl.float32)), axis=0)
        b_GC = tl.sum(tl.where((rows == BT - 1)[:, None], b_G, 0.0), axis=0)  # padding: g = 0
        b_q = tl.load(p_q + ot, mask=mt, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + ot, mask=mt, other=0.0).to(tl.float32)
        # q e^G <= |q|, k e^{-G} <= |k| e^{span}: the products below meet only i >= j
        # entries (dA is masked before them, A after), each a decay times O(1) factors
        b_qg = (b_q * tl.exp(b_G)).to(DT)
        b_ki = (b_k * tl.exp(-b_G)).to(DT)
        # dL/dG_C = e^{G_C} <h_c, dh_c> + sum_j k_j dk_j^inter
        b_gC = tl.exp(b_GC) * b_hdh + tl.sum(b_k * tl.exp(b_GC[None, :] - b_G) * b_dk, axis=0)
        # dq = (scale do h_c^T + dA (k e^{-G})) e^G
        b_dq = tl.dot(b_dA, b_ki, acc=b_dq * scale, input_precision=PREC) * tl.exp(b_G)
        # dk = (v dh_c^T e^{G_C} + dA^T (q e^G)) e^{-G}
        b_dk = tl.dot(tl.trans(b_dA), b_qg, acc=b_dk * tl.exp(b_GC)[None, :],
                      input_precision=PREC) * tl.exp(-b_G)
        # dg_t = sum_{i >= t} (q_i dq_i - k_i dk_i) + dL/dG_C
        b_dg = tl.cumsum(b_q * b_dq - b_k * b_dk, axis=0, reverse=True) + b_gC[None, :]
        tl.store(p_dq + ot, b_dq.to(p_dq.dtype.element_ty), mask=mt)
        tl.store(p_dk + ot, b_dk.to(p_dk.dtype.element_ty), mask=mt)
        tl.store(p_dg + ot, b_dg, mask=mt)
        return tl.dot(b_qg, tl.trans(b_ki), input_precision=PREC)

    @triton.jit
    def _exact_block(p_q, p_k, p_g, p_dq, p_dk, p_dg, b_dq, b_dk, b_hdh, b_dA, n_r, c0, scale,
                     H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKE: tl.constexpr):
        """The exact path (module docstring) on one block of ``BC`` tokens and the ``BKE``
        channels from ``c0``: the cancellation-free ``dg``, one key column at a time.
        ``p_*``: the block's first token (``n_r`` tokens left in the sequence); ``b_dq =
        do h^T``, ``b_dk = v dh^T`` ``[BC, BKE]`` and ``b_hdh = <h, dh>`` ``[BKE]`` with the
        states at the block's start (``h``) and end (``dh``), not yet decayed; ``b_dA``:
        the block's ``scale * tril(do v^T)`` fp32.  Stores dq, dk, dg; returns the block's
        share of ``A`` ``[BC, BC]``."""
        rows = tl.arange(0, BC)
        cols = c0 + tl.arange(0, BKE)
        ot, mt = _tile(0, n_r, H * K, c0, K, 1, BC, BKE)
        b_q = tl.load(p_q + ot, mask=mt, other=0.0).to(tl.float32)
        b_g = reset_floor(tl.load(p_g + ot, mask=mt, other=0.0).to(tl.float32))  # padding: 0
        b_dq = b_dq * (tl.exp(tl.cumsum(b_g, axis=0)) * scale)
        b_dk = b_dk * tl.exp(tl.cumsum(b_g, axis=0, reverse=True) - b_g)  # e^{G_C - G_j}
        # dg_t = sum_{i>=t} a_i + c  (+ sum_{j<t} b_j + straddling W, added per column)
        b_dg = (tl.cumsum(b_q * b_dq, axis=0, reverse=True)
                + (tl.exp(tl.sum(b_g, axis=0)) * b_hdh)[None, :])
        b_A = tl.zeros([BC, BC], dtype=tl.float32)
        # intra-block parts, one key column j at a time: e[i, :] = exp(G_i - G_j), i >= j
        for j in range(BC):
            sel = (rows == j)[:, None]
            k_j = tl.load(p_k + j * (H * K) + cols, mask=(cols < K) & (j < n_r),
                          other=0.0).to(tl.float32)
            # row j of dk holds only dk^inter until this step adds its intra part
            b_j = k_j * tl.sum(tl.where(sel, b_dk, 0.0), axis=0)  # b_j = k_j dk_j^inter
            dA_j = tl.sum(tl.where(rows[None, :] == j, b_dA, 0.0), axis=1)  # dA[:, j]
            # G_i - G_j summed directly: sum_{j < s <= i} g_s (0 on the diagonal)
            b_D = tl.cumsum(tl.where(rows[:, None] > j, b_g, 0.0), axis=0)
            b_e = tl.exp(tl.where(rows[:, None] >= j, b_D, float("-inf")))
            b_X = dA_j[:, None] * b_e  # dA_ij e_ij
            b_dq += b_X * k_j[None, :]
            b_Xq = b_X * b_q
            b_dk += tl.where(sel, tl.sum(b_Xq, axis=0)[None, :], 0.0)
            # straddling pairs j < t <= i: sum_{i>=t} W_ij, for the rows t > j
            b_R = tl.cumsum(b_Xq * k_j[None, :], axis=0, reverse=True)
            b_dg += tl.where(rows[:, None] > j, b_R + b_j[None, :], 0.0)
            a_j = tl.sum(b_q * k_j[None, :] * b_e, axis=1)  # A[:, j], these channels
            b_A += tl.where(rows[None, :] == j, a_j[:, None], 0.0)
        tl.store(p_dq + ot, b_dq.to(p_dq.dtype.element_ty), mask=mt)
        tl.store(p_dk + ot, b_dk.to(p_dk.dtype.element_ty), mask=mt)
        tl.store(p_dg + ot, b_dg, mask=mt)
        return b_A

    @triton.jit
    def _slice_A(p_q, p_k, p_g, n_t, c0, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BKS: tl.constexpr, PREC: tl.constexpr):
        """The fast path's share of ``A`` alone (what :func:`_slice_fast` returns), for the
        ``BKS`` channels from ``c0`` of ``BT`` tokens at ``p_*`` (``n_t`` left)."""
        DT = p_k.dtype.element_ty
        ot, mt = _tile(0, n_t, H * K, c0, K, 1, BT, BKS)
        b_G = tl.cumsum(reset_floor(tl.load(p_g + ot, mask=mt, other=0.0).to(tl.float32)), axis=0)
        b_qg = (tl.load(p_q + ot, mask=mt, other=0.0).to(tl.float32) * tl.exp(b_G)).to(DT)
        b_ki = (tl.load(p_k + ot, mask=mt, other=0.0).to(tl.float32) * tl.exp(-b_G)).to(DT)
        return tl.dot(b_qg, tl.trans(b_ki), input_precision=PREC)

    @triton.jit
    def _chunk_dA(p_v, p_do, n_t, scale, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr):
        """``scale * tril(do v^T)`` of one chunk ``[BT, BT]``, in the operand dtype."""
        DT = p_v.dtype.element_ty
        rows = tl.arange(0, BT)
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            ot, mt = _tile(0, n_t, H * V, i_v * BV, V, 1, BT, BV)
            b_dA += tl.dot(tl.load(p_do + ot, mask=mt, other=0.0).to(DT),
                           tl.trans(tl.load(p_v + ot, mask=mt, other=0.0).to(DT)),
                           input_precision=PREC)
        return tl.where(rows[:, None] >= rows[None, :], b_dA * scale, 0.0).to(DT)

    @triton.jit
    def _chunk_dv(p_k, p_g, p_do, p_dh, p_dv, b_A, n_t, c0, scale, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, PREC: tl.constexpr):
        """``dv = (k e^{G_C - G}) dh_c + scale A^T do`` of one chunk, V tile by V tile, from
        its complete ``A`` (``BK`` channels from ``c0`` cover K); the exponent is a reverse
        sum of gates (terms of one sign)."""
        DT = p_k.dtype.element_ty
        ok, mk = _tile(0, n_t, H * K, c0, K, 1, BT, BK)
        b_g = reset_floor(tl.load(p_g + ok, mask=mk, other=0.0).to(tl.float32))
        b_kd = (tl.load(p_k + ok, mask=mk, other=0.0).to(tl.float32)
                * tl.exp(tl.cumsum(b_g, axis=0, reverse=True) - b_g)).to(DT)
        b_At = tl.trans(b_A * scale).to(DT)
        for i_v in range(tl.cdiv(V, BV)):
            os, ms = _tile(c0, K, V, i_v * BV, V, 1, BK, BV)
            ot, mt = _tile(0, n_t, H * V, i_v * BV, V, 1, BT, BV)
            b_dv = tl.dot(b_kd, tl.load(p_dh + os, mask=ms, other=0.0).to(DT),
                          input_precision=PREC)
            b_dv = tl.dot(b_At, tl.load(p_do + ot, mask=mt, other=0.0).to(DT), acc=b_dv,
                          input_precision=PREC)
            tl.store(p_dv + ot, b_dv.to(p_dv.dtype.element_ty), mask=mt)

    @triton.jit
    def _dqkg_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, a, flags, T, NT, NBT, scale,
                     span_limit, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKS: tl.constexpr,
                     FUSE_DV: tl.constexpr, STORE_A: tl.constexpr, PREC: tl.constexpr):
        """Fast path of one chunk and K tile (module docstring); grid (NT, NK, B*H).

        The tile goes in slices of ``BKS`` channels: a slice whose decay span is at most
        ``span_limit`` gets its ``dq``, ``dk``, ``dg`` here; the others are left to
        ``_dqkg_exact_kernel``, which ``flags [NT, NK, B*H]`` int32 tells which (bit ``s``:
        slice ``s``).  With every slice done here: ``dv`` too (``FUSE_DV``: this tile covers
        K, so ``A`` is complete) or the tile's share of ``A`` into ``a [NK, B, T, H, BT]``
        fp32 for ``_dv_kernel`` (``STORE_A``).
        """
        # chunks on axis 0: CUDA caps axes 1 and 2 at 65535 blocks
        i_t, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        t0 = i_t * BT
        n_t = T - t0
        tok = i_b * T + t0  # the chunk's first token: int64 offsets, int32 within the chunk
        o_k = tok * (H * K) + i_h * K
        o_v = tok * (H * V) + i_h * V
        o_h = ((i_b * NT + i_t) * H + i_h) * K * V
        b_dA = _chunk_dA(v + o_v, do + o_v, n_t, scale, H, V, BT, BV, PREC)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        left = tl.full((), 0, tl.int32)  # bit s: slice s left to the exact kernel
        for i_s in range(BK // BKS):
            c0 = i_k * BK + i_s * BKS
            ot, mt = _tile(0, n_t, H * K, c0, K, 1, BT, BKS)
            # span: the largest sum of |g| over the chunk in one channel, which bounds |G|
            # (for decays, g <= 0, it is -G_C); a column sum, no scan
            b_span = tl.max(tl.sum(tl.abs(reset_floor(tl.load(g + o_k + ot, mask=mt,
                                                                   other=0.0).to(tl.float32))),
                                   axis=0),
                            axis=0)
            if b_span <= span_limit:
                b_A += _slice_fast(q + o_k, k + o_k, g + o_k, v + o_v, do + o_v, h + o_h,
                                   dh + o_h, dq + o_k, dk + o_k, dg + o_k, b_dA, n_t, c0, scale,
                                   H, K, V, BT, BKS, BV, PREC)
            else:
                left = left | (1 << i_s)
        tl.store(flags + (i_t * tl.num_programs(1) + i_k) * tl.num_programs(2) + i_bh, left)
        if left == 0:
            rows = tl.arange(0, BT)
            b_A = tl.where(rows[:, None] >= rows[None, :], b_A, 0.0)
            if STORE_A:
                oa, ma = _tile(0, n_t, H * BT, 0, BT, 1, BT, BT)
                tl.store(a + (i_k * NBT + tok) * (H * BT) + i_h * BT + oa, b_A, mask=ma)
            if FUSE_DV:
                _chunk_dv(k + o_k, g + o_k, do + o_v, dh + o_h, dv + o_v, b_A, n_t, i_k * BK,
                          scale, H, K, V, BT, BK, BV, PREC)

    @triton.jit
    def _exact_chunk_block(q, k, v, g, h, do, dh, dq, dk, dv, dg, a, left, i_t, i_blk, i_k,
                           i_bh, T, NT, NBT, scale, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, BKS: tl.constexpr, BKE: tl.constexpr,
                           NB: tl.constexpr, VP: tl.constexpr, FUSE_DV: tl.constexpr,
                           STORE_A: tl.constexpr, PREC: tl.constexpr):
        """Block ``i_blk`` of chunk ``i_t`` (K tile ``i_k``, head ``i_bh``) on the exact path:
        the slices whose bits are set in ``left``, then the block's rows of ``dv`` (or ``A``).

        Each chunk goes as ``NB`` (1 or 2) blocks of ``BC = BT / NB`` tokens, each with the
        states at its own start and end (module docstring); channels in sub-slices of
        ``BKE``; ``VP``: V padded to a power of two (dv takes all of V at once).  Dynamic
        loops throughout: a rare path, kept small."""
        BC: tl.constexpr = BT // NB
        S_K: tl.constexpr = BC * H * K  # offsets from block 0 to block 1
        S_V: tl.constexpr = BC * H * V
        DT = k.dtype.element_ty
        first = i_blk == 0  # the first block or the second
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        n_t = T - i_t * BT  # tokens left from block 0 on; n_t - BC from block 1 on
        tok = i_b * T + i_t * BT
        o_k = tok * (H * K) + i_h * K  # block 0
        o_v = tok * (H * V) + i_h * V
        o_h = ((i_b * NT + i_t) * H + i_h) * K * V
        n_r = n_t - i_blk * BC  # this block
        o_kb = o_k + i_blk * S_K
        o_vb = o_v + i_blk * S_V
        rows = tl.arange(0, BC)
        tril = rows[:, None] >= rows[None, :]
        # do v^T: this block with itself (dA), block 1 with block 0 (dA10, unscaled)
        b_dA = tl.zeros([BC, BC], dtype=tl.float32)
        b_dA10 = tl.zeros([BC, BC], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            ov, mv = _tile(0, n_r, H * V, i_v * BV, V, 1, BC, BV)
            b_dA += tl.dot(tl.load(do + o_vb + ov, mask=mv, other=0.0).to(DT),
                           tl.trans(tl.load(v + o_vb + ov, mask=mv, other=0.0).to(DT)),
                           input_precision=PREC)
            if NB == 2:
                ov0, mv0 = _tile(0, n_t, H * V, i_v * BV, V, 1, BC, BV)
                ov1, mv1 = _tile(0, n_t - BC, H * V, i_v * BV, V, 1, BC, BV)
                b_dA10 += tl.dot(
                    tl.load(do + o_v + S_V + ov1, mask=mv1, other=0.0).to(DT),
                    tl.trans(tl.load(v + o_v + ov0, mask=mv0, other=0.0).to(DT)),
                    input_precision=PREC)
        b_dA = tl.where(tril, b_dA * scale, 0.0)
        b_A = tl.zeros([BC, BC], dtype=tl.float32)  # this block's A
        b_A10 = tl.zeros([BC, BC], dtype=tl.float32)  # A across the blocks
        for i_s in range(BK // BKS):
            done = ((left >> i_s) & 1) == 0  # by _dqkg_kernel: only its share of A here
            for i_e in range(BKS // BKE):
                c0 = i_k * BK + i_s * BKS + i_e * BKE
                if NB == 2:
                    # the products across the blocks take the reference between them:
                    # k e^{decay to the end of block 0}, q e^{decay from its end}, <= 1
                    og, mg = _tile(0, n_t, H * K, c0, K, 1, BC, BKE)
                    b_g0 = reset_floor(tl.load(g + o_k + og, mask=mg, other=0.0).to(tl.float32))
                    b_k0r = (tl.load(k + o_k + og, mask=mg, other=0.0).to(tl.float32)
                             * tl.exp(tl.cumsum(b_g0, axis=0, reverse=True) - b_g0))
                    og, mg = _tile(0, n_t - BC, H * K, c0, K, 1, BC, BKE)
                    b_g1 = reset_floor(tl.load(g + o_k + S_K + og, mask=mg,
                                               other=0.0).to(tl.float32))
                    b_q1g = (tl.load(q + o_k + S_K + og, mask=mg, other=0.0).to(tl.float32)
                             * tl.exp(tl.cumsum(b_g1, axis=0)))
                    b_A10 += tl.dot(b_q1g.to(DT), tl.trans(b_k0r.to(DT)),
                                    input_precision=PREC)
                if done:
                    b_A += _slice_A(q + o_kb, k + o_kb, g + o_kb, n_r, c0, H, K, BC, BKE,
                                    PREC)
                else:
                    # products with the chunk's states h_c, dh_c, V tile by V tile:
                    # do_b h_c^T, v_b dh_c^T of block b
                    b_q0 = tl.zeros([BC, BKE], dtype=tl.float32)
                    b_k0 = tl.zeros([BC, BKE], dtype=tl.float32)
                    b_q1 = tl.zeros([BC, BKE], dtype=tl.float32)
                    b_k1 = tl.zeros([BC, BKE], dtype=tl.float32)
                    b_hdh = tl.zeros([BKE], dtype=tl.float32)
                    for i_v in range(tl.cdiv(V, BV)):
                        os, ms = _tile(i_v * BV, V, 1, c0, K, V, BV, BKE)  # [BV, BKE]
                        b_ht = tl.load(h + o_h + os, mask=ms, other=0.0)
                        b_dht = tl.load(dh + o_h + os, mask=ms, other=0.0)
                        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
                        ov, mv = _tile(0, n_t, H * V, i_v * BV, V, 1, BC, BV)
                        b_q0 += tl.dot(tl.load(do + o_v + ov, mask=mv, other=0.0).to(DT),
                                       b_ht.to(DT), input_precision=PREC)
                        b_k0 += tl.dot(tl.load(v + o_v + ov, mask=mv, other=0.0).to(DT),
                                       b_dht.to(DT), input_precision=PREC)
                        if NB == 2:
                            ov, mv = _tile(0, n_t - BC, H * V, i_v * BV, V, 1, BC, BV)
                            b_q1 += tl.dot(tl.load(do + o_v + S_V + ov, mask=mv,
                                                   other=0.0).to(DT),
                                           b_ht.to(DT), input_precision=PREC)
                            b_k1 += tl.dot(tl.load(v + o_v + S_V + ov, mask=mv,
                                                   other=0.0).to(DT),
                                           b_dht.to(DT), input_precision=PREC)
                    if NB == 2:
                        # block 0 ends with the state gradient dh_m = e^{G_C1} dh_c +
                        # scale (q_1 e^{G_1})^T do_1, block 1 starts from the state
                        # h_m = e^{G_C0} h_c + (k_0 e^{r_0})^T v_0: their products
                        # through the ones with h_c, dh_c and do_1 v_0^T
                        b_eC0 = tl.exp(tl.sum(b_g0, axis=0))  # decays over block 0, 1
                        b_eC1 = tl.exp(tl.sum(b_g1, axis=0))
                        b_hdh = tl.where(
                            first, b_hdh * b_eC1 + tl.sum(b_q1g * b_q1, axis=0) * scale,
                            b_hdh * b_eC0 + tl.sum(b_k0r * b_k0, axis=0))
                        b_q0 = tl.where(first, b_q0, b_q1 * b_eC0[None, :] + tl.dot(
                            b_dA10.to(DT), b_k0r.to(DT), input_precision=PREC))
                        b_k0 = tl.where(first, b_k0 * b_eC1[None, :] + tl.dot(
                            tl.trans(b_dA10 * scale).to(DT), b_q1g.to(DT),
                            input_precision=PREC), b_k1)
                    b_A += _exact_block(q + o_kb, k + o_kb, g + o_kb, dq + o_kb,
                                        dk + o_kb, dg + o_kb, b_q0, b_k0, b_hdh, b_dA, n_r,
                                        c0, scale, H, K, BC, BKE)
        b_A = tl.where(tril, b_A, 0.0)
        if STORE_A:  # this block's rows of A [BT, BT]: (A, 0) or (A10, A)
            oa, ma = _tile(0, n_r, H * BT, 0, BT, 1, BC, BC)
            p_a = a + (i_k * NBT + tok) * (H * BT) + i_h * BT + i_blk * BC * (H * BT)
            if NB == 2:
                tl.store(p_a + oa, tl.where(first, b_A, b_A10), mask=ma)
                tl.store(p_a + BC + oa, tl.where(first, 0.0, b_A), mask=ma)
            else:
                tl.store(p_a + oa, b_A, mask=ma)
        if FUSE_DV:
            # dv = (k e^{G_C - G}) dh_c + scale A^T do for this block's rows (block 0
            # also takes A10^T do_1), all of V at once
            ov, mv = _tile(0, n_r, H * V, 0, V, 1, BC, VP)
            b_dv = tl.dot(tl.trans(b_A * scale).to(DT),
                          tl.load(do + o_vb + ov, mask=mv, other=0.0).to(DT),
                          input_precision=PREC)
            if NB == 2:
                ov1, mv1 = _tile(0, n_t - BC, H * V, 0, V, 1, BC, VP)
                b_dv = tl.dot(tl.trans(tl.where(first, b_A10 * scale, 0.0)).to(DT),
                              tl.load(do + o_v + S_V + ov1, mask=mv1, other=0.0).to(DT),
                              acc=b_dv, input_precision=PREC)
            for i_kk in range(tl.cdiv(BK, BKE)):
                c0 = i_k * BK + i_kk * BKE
                og, mg = _tile(0, n_r, H * K, c0, K, 1, BC, BKE)
                b_g = reset_floor(tl.load(g + o_kb + og, mask=mg, other=0.0).to(tl.float32))
                b_r = tl.cumsum(b_g, axis=0, reverse=True) - b_g
                if NB == 2:  # block 0's rows decay over block 1 too
                    og1, mg1 = _tile(0, n_t - BC, H * K, c0, K, 1, BC, BKE)
                    b_r += tl.where(first, tl.sum(reset_floor(tl.load(
                        g + o_k + S_K + og1, mask=mg1, other=0.0).to(tl.float32)), axis=0),
                        0.0)[None, :]
                b_kd = (tl.load(k + o_kb + og, mask=mg, other=0.0).to(tl.float32)
                        * tl.exp(b_r)).to(DT)
                oh, mh = _tile(c0, K, V, 0, V, 1, BKE, VP)
                b_dv = tl.dot(b_kd, tl.load(dh + o_h + oh, mask=mh, other=0.0).to(DT),
                              acc=b_dv, input_precision=PREC)
            tl.store(dv + o_vb + ov, b_dv.to(dv.dtype.element_ty), mask=mv)

    @triton.jit
    def _dqkg_exact_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, a, flags, T, NT, NBT, scale,
                           CH, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           BKS: tl.constexpr, BKE: tl.constexpr, NB: tl.constexpr,
                           VP: tl.constexpr, BF: tl.constexpr, FUSE_DV: tl.constexpr,
                           STORE_A: tl.constexpr, PREC: tl.constexpr):
        """Exact path: what ``_dqkg_kernel`` left (its ``flags``); grid (cdiv(NT, CH), NK,
        B*H), one program per ``CH`` chunks of one K tile and head.  A separate kernel so
        that its registers do not weigh on the fast path.  The flags go ``BF`` chunks per
        load and ``CH`` is sized to a few programs per SM: with mild gates the programs only
        read them (one program per chunk, at one CTA per SM, would cost a wave of launches
        per 132 chunks)."""
        i_g, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        NK = tl.num_programs(1)
        NBH = tl.num_programs(2)
        c_end = tl.minimum((i_g + 1) * CH, NT)
        lanes = tl.arange(0, BF)
        for c0 in range(i_g * CH, c_end, BF):
            cs = c0 + lanes
            f = tl.load(flags + (cs * NK + i_k) * NBH + i_bh, mask=cs < c_end, other=0)
            if tl.max(f, axis=0) != 0:
                for i in range(BF):
                    left = tl.sum(tl.where(lanes == i, f, 0), axis=0)
                    if left != 0:
                        for i_blk in range(NB):
                            _exact_chunk_block(q, k, v, g, h, do, dh, dq, dk, dv, dg, a, left,
                                               c0 + i, i_blk, i_k, i_bh, T, NT, NBT, scale, H,
                                               K, V, BT, BK, BV, BKS, BKE, NB, VP, FUSE_DV,
                                               STORE_A, PREC)

    @triton.jit
    def _dv_kernel(k, g, do, dh, a, dv, T, NT, NBT, NA, scale, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr):
        """``dv = dh_c^T (k * e^r) + scale A^T do`` with ``A`` the sum of the ``NA`` partials
        in ``a [NA, B, T, H, BT]``; grid (NT, NV, B*H)."""
        i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # chunks on axis 0
        i_b = (i_bh // H).to(tl.int64)
        i_h = i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        DT = k.dtype.element_ty
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)
        base_h = ((i_b * NT + i_t) * H + i_h) * K * V
        for i_k in range(tl.cdiv(K, BK)):
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                    (t0, i_k * BK), (BT, BK), (1, 0))
            p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                    (t0, i_k * BK), (BT, BK), (1, 0))
            p_dh = tl.make_block_ptr(dh + base_h, (K, V), (V, 1), (i_k * BK, i_v * BV),
                                     (BK, BV), (1, 0))
            b_g = reset_floor(tl.load(p_g, boundary_check=(0, 1)).to(tl.float32))
            b_r = tl.cumsum(b_g, axis=0, reverse=True) - b_g
            b_kd = (tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * tl.exp(b_r)).to(DT)
            b_dh = tl.load(p_dh, boundary_check=(0, 1)).to(DT)
            b_dv += tl.dot(b_kd, b_dh, input_precision=PREC)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_a in range(NA):
            p_a = tl.make_block_ptr(a + ((i_a * NBT + bos) * H + i_h) * BT, (T, BT),
                                    (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
            b_A += tl.load(p_a, boundary_check=(0, 1))
        p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                 (t0, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
        b_dv += tl.dot(tl.trans(b_A * scale).to(DT), b_do, input_precision=PREC)
        p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                 (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))


def default_tiles(B: int, H: int, K: int, V: int, device: torch.device, *,
                  dtype: torch.dtype = torch.bfloat16, BT: int = CHUNK) -> dict:
    """Tile sizes per kernel (module docstring for the resources they compile to).

    ``walk_*``: state tile of the two walks, shrunk (64 -> 32, K first) until there are 1.5
    programs per SM (as in scalar_backward.py).  ``dqk_BK``: K tile of the fast kernel, the
    whole K up to 128 (then dv fuses into it; ``fuse_dv=False`` forces the separate dv
    kernel); ``dqk_BKS``: the slice of channels it handles at a time (and the unit of the
    fast/exact choice), 64 (32 at ``BT < 64``; 16 for fp32, whose 3xTF32 dots take more
    registers: the largest without spills, or with the fewest, on sm_90);
    ``dqk_BV``: its V loop tile.  ``exact_BK``: the exact kernel's channel sub-slice (at most
    ``dqk_BKS``), 64 (16 for fp32), ``exact_warps`` its warps, ``exact_CH`` its chunks per
    program (0: about 8 programs per SM).  ``dv_*``: the separate dv kernel (several K
    tiles).  16-bit inputs at ``BT = 64`` take 4 warps and 32-channel slices: on an H200 at
    T=64K, B=1, H=32, K=V=128 bf16 the backward took 14.7 ms that way against 17.2 ms with
    8 warps and 64 channels, 20.7 with 8 warps and 32 (results/gla_bwd_probe_*_2026-11-24).
    """
    PK, PV = next_pow2(K), next_pow2(V)
    BK, BV = min(64, PK), min(64, PV)
    target = 3 * sm_count(device) // 2
    while B * H * cdiv(K, BK) * cdiv(V, BV) < target and max(BK, BV) > 32:
        if BK >= BV:
            BK //= 2
        else:
            BV //= 2
    f32 = dtype == torch.float32
    dqk_BK = min(128, PK)
    dqk_BV = min(16 if f32 or BT < 32 else 32, PV)
    # 8 warps only where the fast kernel's V loop runs more than once: compiled by Triton 3.6
    # for sm_90 with a single V tile (fp32, V <= dqk_BV) it made illegal memory accesses
    # (fp32 at K=16/V=16, K=32/V=16, V=32 with dqk_BV=32 on an H200; 4 warps ran them all)
    dqk_warps = 8 if f32 and BT >= 32 and V > dqk_BV else 4
    return {"walk_BK": BK, "walk_BV": BV, "walk_warps": 4, "walk_stages": 2,
            "dqk_BK": dqk_BK, "dqk_BKS": min(16 if f32 else 32, dqk_BK),
            "dqk_BV": dqk_BV, "dqk_warps": dqk_warps, "dqk_stages": 2,
            "exact_BK": 16 if f32 else 64, "exact_warps": 8 if BT >= 32 else 4, "exact_CH": 0,
            "dv_BV": min(64, PV), "dv_BK": min(64, PK), "dv_warps": 4, "dv_stages": 2,
            "fuse_dv": True}


def _check(name: str, t: Tensor | None, shape: tuple, device: torch.device, *,
           optional: bool = False) -> None:
    if t is None:
        if not optional:
            raise ValueError(f"{name}: a tensor is required")
        return
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, q on {device}")


def backward_program(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype,
                     has_h0: bool, has_dht: bool, scale: float, prec: str, BT: int = CHUNK,
                     tiles: dict | None = None, state_dtype: torch.dtype | None = None,
                     sms: int = 132, do_dtype: torch.dtype | None = None,
                     fuse_dv: bool | None = None):
    """The launches of :func:`vector_decay_backward` as a
    :class:`~forge_dist.kernels.ir.Program` (one source for the function, the plans'
    backward and the AOT cache).

    Buffers: inputs ``q, k [B, T, H, K]``, ``v`` and ``do [B, T, H, V]`` (``dtype``;
    ``do_dtype`` for ``do`` when it differs), ``g`` fp32 ``[B, T, H, K]``, ``h0`` and
    ``dht`` fp32 ``[B, H, K, V]`` (``has_h0``, ``has_dht``); outputs ``dq, dk, dv``
    (``dtype``), ``dg`` fp32 ``[B, T, H, K]`` and ``dh0`` fp32 (``has_h0``); scratch ``h,
    dh [B, NT, H, K, V]`` (``state_dtype``), the fast kernel's ``flags`` int32 and, unless
    dv fuses into it, the partial attentions ``a [NK, B, T, H, BT]`` fp32.  ``sms``: the
    SM count the walk tiles and the exact kernel's chunks per program are sized for;
    ``fuse_dv=False`` forces the separate dv kernel.
    """

    if BT not in (16, 32, 64):
        raise ValueError(f"BT: expected 16, 32 or 64, got {BT}")
    cfg = default_tiles(B, H, K, V, sms, dtype=dtype, BT=BT)
    if tiles:
        unknown = set(tiles) - set(cfg)
        if unknown:
            raise ValueError(f"tiles: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(tiles)
    for key in ("dqk_BK", "dqk_BKS", "dqk_BV", "exact_BK"):
        if cfg[key] < 1 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"tiles: {key} must be a power of two, got {cfg[key]}")
    BKS = min(cfg["dqk_BKS"], cfg["dqk_BK"])
    if cfg["dqk_BK"] // BKS > 31:  # the fast kernel's flags hold one bit per slice
        raise ValueError(f"tiles: at most 31 slices of dqk_BKS per dqk_BK, got "
                         f"{cfg['dqk_BK']} // {BKS}")
    NT = cdiv(T, BT)
    NK = cdiv(K, cfg["dqk_BK"])
    fuse = (bool(cfg["fuse_dv"]) and NK == 1) if fuse_dv is None else fuse_dv
    sdt = state_dtype or (torch.float32 if dtype == torch.float32 else dtype)
    f32 = torch.float32
    bufs = {"q": Buffer((B, T, H, K), dtype, "input"), "k": Buffer((B, T, H, K), dtype, "input"),
            "v": Buffer((B, T, H, V), dtype, "input"), "g": Buffer((B, T, H, K), f32, "input"),
            "do": Buffer((B, T, H, V), do_dtype or dtype, "input"),
            "dq": Buffer((B, T, H, K), dtype, "output"),
            "dk": Buffer((B, T, H, K), dtype, "output"),
            "dv": Buffer((B, T, H, V), dtype, "output"),
            "dg": Buffer((B, T, H, K), f32, "output"),
            "h": Buffer((B, NT, H, K, V), sdt, "scratch"),
            "dh": Buffer((B, NT, H, K, V), sdt, "scratch"),
            "flags": Buffer((NT * NK * B * H,), torch.int32, "scratch")}
    if not fuse:
        bufs["a"] = Buffer((NK, B, T, H, BT), f32, "scratch")
    state_buffers(bufs, (B, H, K, V), has_h0=has_h0, has_dht=has_dht)
    buf = buffer_args(bufs, "h")
    dims = (("H", H), ("K", K), ("V", V), ("BT", BT))
    # the two walks are scalar_backward's, with per-channel gates
    launches = state_walks(buf, B=B, T=T, H=H, K=K, V=V, BT=BT, gate=2, has_h0=has_h0,
                           has_dht=has_dht, scale=scale, prec=prec, cfg=cfg)
    args = tuple((n, *buf(n)) for n in ("q", "k", "v", "g", "h", "do", "dh", "dq", "dk",
                                         "dv", "dg")) + (
        ("a", *buf("a", dummy="dg")), ("flags", *buf("flags")), ("T", "i32", T),
        ("NT", "i32", NT), ("NBT", "i32", B * T), ("scale", "fp32", float(scale)))
    flags = (("FUSE_DV", fuse), ("STORE_A", not fuse), ("PREC", prec))
    tiles_dqk = dims + (("BK", cfg["dqk_BK"]), ("BV", cfg["dqk_BV"]), ("BKS", BKS))
    launches.append(Launch("gla_dqkg", (NT, NK, B * H),
                           args + (("span_limit", "fp32", vector.span_max(dtype)),),
                           tiles_dqk + flags, cfg["dqk_warps"], cfg["dqk_stages"]))
    # about 8 exact-kernel programs per SM, CH chunks each
    CH = cfg["exact_CH"] or max(1, min(64, NT * NK * B * H // (8 * sms)))
    launches.append(Launch("gla_dqkg_exact", (cdiv(NT, CH), NK, B * H),
                           args + (("CH", "i32", CH),),
                           tiles_dqk + (("BKE", min(cfg["exact_BK"], BKS)),
                                        ("NB", 2 if BT == 64 else 1), ("VP", next_pow2(V)),
                                        ("BF", EXACT_BF)) + flags,
                           cfg["exact_warps"], 1))
    if not fuse:
        launches.append(Launch(
            "gla_dv", (NT, cdiv(V, cfg["dv_BV"]), B * H),
            (("k", *buf("k")), ("g", *buf("g")), ("do", *buf("do")), ("dh", *buf("dh")),
             ("a", *buf("a")), ("dv", *buf("dv")), ("T", "i32", T), ("NT", "i32", NT),
             ("NBT", "i32", B * T), ("NA", "i32", NK), ("scale", "fp32", float(scale))),
            dims + (("BK", cfg["dv_BK"]), ("BV", cfg["dv_BV"]), ("PREC", prec)),
            cfg["dv_warps"], cfg["dv_stages"]))
    return Program(launches, bufs, "backward",
                   [f"backward: {len(launches)} launches, chunk states in {sdt}"])


def vector_decay_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S_in: Tensor | None,
                          do: Tensor | None, dht: Tensor | None, scale: float, *,
                          BT: int = CHUNK, tiles: dict | None = None,
                          state_dtype: torch.dtype | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of ``(o, S_T)`` of the vector-decay recurrence (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp16/bf16/fp32, one dtype; K, V in 16..256).
        g: natural-log decays per token and key channel ``[B, T, H, K]`` (any float dtype).
        S_in: incoming state ``[B, H, K, V]`` or ``None`` (zeros).
        do: gradient of ``o`` ``[B, T, H, V]`` (any float dtype) or ``None`` (zeros).
        dht: gradient of the final state ``[B, H, K, V]`` or ``None`` (zeros).
        scale: the query scale of the forward.
        BT: chunk length in tokens (16, 32 or 64).
        tiles: overrides of :func:`default_tiles` (tests use it to force several tiles).
        state_dtype: dtype of the stored chunk states ``h`` and ``dh`` (default: fp32 for
            fp32 inputs, the input dtype otherwise).
    Returns:
        ``(dq, dk, dv, dg, dS_in)``: dq, dk, dv in the dtypes of q, k, v; dg ``[B, T, H, K]``
        fp32; dS_in ``[B, H, K, V]`` fp32 (``None`` without ``S_in``).
    """
    if not HAVE_TRITON:
        raise RuntimeError("vector_decay_backward needs triton")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected a [B, T, H, K] tensor, got "
                         f"{list(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    B, T, H, K = q.shape
    if not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError("v: expected a [B, T, H, V] tensor")
    V = v.shape[-1]
    dev = q.device
    _check("k", k, (B, T, H, K), dev)
    _check("v", v, (B, T, H, V), dev)
    _check("g", g, (B, T, H, K), dev)
    _check("S_in", S_in, (B, H, K, V), dev, optional=True)
    _check("do", do, (B, T, H, V), dev, optional=True)
    _check("dht", dht, (B, H, K, V), dev, optional=True)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q: dtype {q.dtype} not supported (fp16, bf16, fp32)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"k, v: dtypes must equal q's ({q.dtype}), got {k.dtype}, {v.dtype}")
    if T < 1:
        raise ValueError("q: T (dim 1) must be >= 1")
    for name, d in (("K (q.shape[-1])", K), ("V (v.shape[-1])", V)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {d} outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    do = torch.zeros_like(v) if do is None else do.contiguous()
    prog = backward_program(B, T, H, K, V, dtype=q.dtype, has_h0=S_in is not None,
                            has_dht=dht is not None, scale=scale, prec=dot_precision(q.dtype),
                            BT=BT, tiles=tiles, state_dtype=state_dtype, sms=sm_count(dev),
                            do_dtype=do.dtype)
    tensors = {"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(),
               "g": g.to(torch.float32).contiguous(), "do": do}
    if S_in is not None:
        tensors["h0"] = S_in.to(torch.float32).contiguous()
    if dht is not None:
        tensors["dht"] = dht.to(torch.float32).contiguous()
    prog.execute(tensors, dev)
    return tensors["dq"], tensors["dk"], tensors["dv"], tensors["dg"], tensors.get("dh0")


def kernel_specs(K: int, V: int, dtype: torch.dtype = torch.bfloat16, *, B: int = 1,
                 H: int = 32, BT: int = CHUNK, tiles: dict | None = None,
                 has_h0: bool = True, has_dht: bool = True, fuse_dv: bool | None = None,
                 do_dtype: torch.dtype | None = None, device: str = "cpu") -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of each launch that
    :func:`vector_decay_backward` makes for these dims with its default tiles (for AOT
    compilation and the shared-memory check; pointer types as that launch passes them).
    ``fuse_dv=False`` lists the unfused dq/dk/dg kernels and the dv kernel whatever K is;
    ``do_dtype`` defaults to ``dtype``; ``device`` sizes the walk tiles by its SM count
    ("cpu": a nominal 132-SM H100/H200)."""
    return backward_program(B, 256, H, K, V, dtype=dtype, has_h0=has_h0, has_dht=has_dht,
                            scale=K ** -0.5, prec="tf32x3", BT=BT, tiles=tiles,
                            sms=sm_count(torch.device(device)), do_dtype=do_dtype,
                            fuse_dv=fuse_dv).specs()

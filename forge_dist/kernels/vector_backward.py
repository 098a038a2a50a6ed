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

    dL/dG_ik  = q_ik dq_ik - k_ik dk_ik
    dL/dG_Ck  = e^{G_Ck} sum_v h_c[k, v] dh_c[k, v] + sum_j k_jk dk_jk^inter

and ``dg_tk = sum_{i>=t} dL/dG_ik + dL/dG_Ck``.  That sum cancels catastrophically at steep
gates (the diagonal ``i = j`` intra terms ``dA_ii q_ik k_ik`` are O(1) in both ``q.dq`` and
``k.dk``, while the true ``dg`` is O(e^g)).  Expanded, the exactly cancelling pairs dropped::

    dg_tk = sum_{i>=t} a_ik + sum_{j<t} b_jk + c_k + sum_{j<t<=i} W_ijk
    a_ik  = q_ik dq_ik^inter,   b_jk = k_jk dk_jk^inter,   c_k = e^{G_Ck} <h_c[k], dh_c[k]>,
    W_ijk = dA_ij q_ik k_jk e^{G_ik - G_jk}

(the intra terms are exactly the pairs whose decay contains ``g_t``).  Every term carries its
own decay, so the form is cancellation-free: what cancels in it is only the genuine sign
mixing of the terms of ``dg`` itself.  Measured in fp32 (tests/kernels/test_vector_backward.py,
gates of -20..-34 per token on three of four channels): relative error of ``dg`` 4e-7 on the
steep channels (1.4e-6 on the worst single channel), where the naive sum in the same fp32
arithmetic, even from exact ``dq`` and ``dk``, is off by a factor of ~700.

Unlike the scalar case ``W`` is ``[BT, BT, K]``: the kernel builds it one column ``j`` at a
time (``[BT, BK]``) inside the same loop that forms the intra parts of ``dq``, ``dk`` and
``A``, reverse-sums it over ``i`` and adds it with ``b_j`` to the rows ``t > j``.  That is
``O(BT^2 K)`` elementwise work and exponentials per chunk (about 15 ``[BT, BK]`` operations
and one ``[BT, BK]`` exponential per column), the same order as the forward's
column-by-column ``A`` (vector.py), next to ``O(BT K V)`` tensor-core work of the dots; no
second loop, no extra memory.  The short chunk (``BT = 32`` by default) keeps that cost per
token (``O(BT K)``) small; the price is more stored states (``NT = T / BT``).

Exponents.  Every exponent is a non-positive sum of log decays, never a product
``e^{+G} e^{-G}``: the intra decay ``G_i - G_j`` is summed directly, ``sum_{j<s<=i} g_s``
(a cumulative sum of the gates masked to ``s > j``; the ``i < j`` entries are masked to
``-inf`` before the exponential), so it is exact to a few ulps of itself instead of ulps of
``G_i`` (hundreds at gates of -20 per token: ~6e-5 absolute error in a difference of two
prefix sums); ``r_j`` is a reverse cumulative sum less the own gate (terms of one sign).

Kernels (three or four launches):

1. ``_fwd_states_kernel`` (scalar_backward.py, ``GATE=2``) -- chunk-start states ``h``.
2. ``_bwd_states_kernel`` (same, ``GATE=2``) -- the reverse walk for ``dh`` and ``dS_in``.
3. ``_dqkg_kernel`` -- chunk-parallel, grid ``(NT, K tiles, B * H)``: the V loop forms
   ``dA``, the inter parts of ``dq``, ``dk`` and ``<h_c, dh_c>`` per channel; the column loop
   the intra parts, ``dg`` and this K tile's share of ``A``.  Everything but ``dA`` and
   ``A`` is per key channel, so K tiles are independent (``dg`` needs no cross-tile sum).
   With one K tile (``K <= 128`` at ``BT <= 32``) ``A`` is complete and ``dv`` follows in a
   second V loop (``FUSE_DV``, re-reading the ``dh`` tile the first loop just read, most
   likely from L2); otherwise the tile's ``A`` goes to ``a [NK, B, T, H, BT]`` fp32.
4. ``_dv_kernel`` -- only with several K tiles: grid ``(NT, V tiles, B * H)``, sums the
   ``A`` partials and loops over K tiles for ``dh_c^T (k * e^r)``.

Compiled for sm_90 (``kernel_specs``, Triton 3.6, ptxas -v), default tiles, bf16: shared
memory per block 12 KB (walks) and 28 KB (dq/dk/dg with fused dv) at K = V = 128; 28 KB
(walks), 20 KB (dq/dk/dg) and 24 KB (dv) at K = V = 256; no register spills.

``h`` and ``dh`` are stored in the input dtype for 16-bit inputs (the dots consume them in that
dtype anyway) and in fp32 for fp32 inputs; every accumulation is fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import HAVE_TRITON, dot_precision, next_pow2, tl, triton, value_state_tiles
from .scalar_backward import _bwd_states_kernel, _fwd_states_kernel, _sm_count

__all__ = ["default_tiles", "kernel_specs", "vector_decay_backward"]

CHUNK = 32  # default BT: the column loops cost O(BT) per token, the stored states O(1/BT)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs tiles of 16 and more


if HAVE_TRITON:

    @triton.jit
    def _dqkg_kernel(q, k, v, g, h, do, dh, dq, dk, dv, dg, a, T, NT, NBT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, FUSE_DV: tl.constexpr,
                     STORE_A: tl.constexpr, PREC: tl.constexpr):
        """``dq``, ``dk``, ``dg`` of one K tile (module docstring); grid (NT, NK, B*H).

        ``FUSE_DV``: this tile covers K, so ``A`` is complete: also ``dv``.  ``STORE_A``: store
        the tile's share of ``A`` into ``a [NK, B, T, H, BT]`` fp32 for ``_dv_kernel``.
        """
        # chunks on axis 0: CUDA caps axes 1 and 2 at 65535 blocks
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
        p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                (t0, i_k * BK), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32)
        b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)  # padding: 0
        b_G = tl.cumsum(b_g, axis=0)
        b_GC = tl.sum(b_g, axis=0)
        b_er = tl.exp(tl.cumsum(b_g, axis=0, reverse=True) - b_g)  # e^{G_C - G_j}
        rows = tl.arange(0, BT)
        cols = i_k * BK + tl.arange(0, BK)
        if FUSE_DV:  # k * e^r for dv, made now so that neither k nor r stays live below
            b_kd = (tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * b_er).to(DT)

        # inter-chunk parts and dA = do v^T, looping over V tiles
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)  # sum_v h_c[k, v] dh_c[k, v]
        base_h = ((i_b * NT + i_t) * H + i_h) * K * V
        for i_v in range(tl.cdiv(V, BV)):
            b_v, b_do, b_ht, b_dht = value_state_tiles(v, do, h, dh, bos, i_h, t0, i_v, i_k,
                                                       base_h, T, H, K, V, BT, BK, BV)
            b_v, b_do = b_v.to(DT), b_do.to(DT)
            b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
            b_dq += tl.dot(b_do, b_ht.to(DT), input_precision=PREC)
            b_dk += tl.dot(b_v, b_dht.to(DT), input_precision=PREC)
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
        b_dq = b_dq * (tl.exp(b_G) * scale)
        b_dk = b_dk * b_er
        # dg_t = sum_{i>=t} a_i + c  (+ sum_{j<t} b_j + straddling W, added per column below)
        b_dg = tl.cumsum(b_q * b_dq, axis=0, reverse=True) + (tl.exp(b_GC) * b_hdh)[None, :]
        b_dA = tl.where(rows[:, None] >= rows[None, :], b_dA * scale, 0.0)

        # intra-chunk parts, one key column j at a time: e[i, :] = exp(G_i - G_j), i >= j
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        p_kj = k + (bos * H + i_h) * K + cols
        for j in range(BT):
            sel = (rows == j)[:, None]
            t_j = t0 + j
            k_j = tl.load(p_kj + t_j.to(tl.int64) * (H * K), mask=(cols < K) & (t_j < T),
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
            if FUSE_DV or STORE_A:
                a_j = tl.sum(b_q * k_j[None, :] * b_e, axis=1)  # A[:, j], this K tile
                b_A = tl.where(rows[None, :] == j, a_j[:, None], b_A)

        p_dq = tl.make_block_ptr(dq + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                 (t0, i_k * BK), (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                 (t0, i_k * BK), (BT, BK), (1, 0))
        p_dg = tl.make_block_ptr(dg + (bos * H + i_h) * K, (T, K), (H * K, 1),
                                 (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
        tl.store(p_dg, b_dg, boundary_check=(0, 1))
        if STORE_A:
            p_a = tl.make_block_ptr(a + ((i_k * NBT + bos) * H + i_h) * BT, (T, BT),
                                    (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
            tl.store(p_a, b_A, boundary_check=(0, 1))
        if FUSE_DV:
            # dv = dh_c^T (k * e^r) + scale A^T do, V tile by V tile
            b_At = tl.trans(b_A * scale).to(DT)
            for i_v in range(tl.cdiv(V, BV)):
                p_dh = tl.make_block_ptr(dh + base_h, (K, V), (V, 1), (i_k * BK, i_v * BV),
                                         (BK, BV), (1, 0))
                p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                         (t0, i_v * BV), (BT, BV), (1, 0))
                b_dh = tl.load(p_dh, boundary_check=(0, 1)).to(DT)
                b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
                b_dv = tl.dot(b_kd, b_dh, input_precision=PREC)
                b_dv += tl.dot(b_At, b_do, input_precision=PREC)
                p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1),
                                         (t0, i_v * BV), (BT, BV), (1, 0))
                tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))

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
            b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
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
    """Tile sizes per kernel.

    ``walk_BK/walk_BV``: state tile of the two walks, shrunk (64 -> 32, K first) until there
    are 1.5 programs per SM (as in scalar_backward.py).  ``dqk_BK``: K tile of the dq/dk/dg
    kernel, the whole K up to 128 at ``BT <= 32`` (then dv fuses into it; 64 at ``BT = 64``),
    so that the ``[BT, BK]`` fp32 tensors of its column loop fit in 8 warps' registers;
    ``dqk_BV``: its V loop tile, 32 (16 for fp32 or ``BT = 16``): the ``[BV, BK]`` h and dh
    tiles share the registers with those tensors (ptxas -v for sm_90 reports no spills at
    K = V = 128 and 256 in bf16, a few bytes in fp32).  ``dv_BV/dv_BK``: output tile / K loop
    tile of the separate dv kernel.
    """
    PK, PV = next_pow2(K), next_pow2(V)
    BK, BV = min(64, PK), min(64, PV)
    target = 3 * _sm_count(device) // 2
    while B * H * triton.cdiv(K, BK) * triton.cdiv(V, BV) < target and max(BK, BV) > 32:
        if BK >= BV:
            BK //= 2
        else:
            BV //= 2
    dqk_BK = min(128 if BT <= 32 else 64, PK)
    dqk_BV = min(16 if dtype == torch.float32 or BT < 32 else 32, PV)
    return {"walk_BK": BK, "walk_BV": BV, "walk_warps": 4, "walk_stages": 2,
            "dqk_BK": dqk_BK, "dqk_BV": dqk_BV, "dqk_warps": 8 if BT >= 32 else 4,
            "dqk_stages": 2, "dv_BV": min(64, PV), "dv_BK": min(64, PK), "dv_warps": 4,
            "dv_stages": 2, "fuse_dv": True}


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
    if BT not in (16, 32, 64):
        raise ValueError(f"BT: expected 16, 32 or 64, got {BT}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g32 = g.to(torch.float32).contiguous()
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dht = None if dht is None else dht.to(torch.float32).contiguous()
    h0 = None if S_in is None else S_in.to(torch.float32).contiguous()
    scale = float(scale)

    cfg = default_tiles(B, H, K, V, dev, dtype=q.dtype, BT=BT)
    if tiles:
        unknown = set(tiles) - set(cfg)
        if unknown:
            raise ValueError(f"tiles: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(tiles)
    NT = triton.cdiv(T, BT)
    prec = dot_precision(q.dtype)
    sdt = state_dtype or (torch.float32 if q.dtype == torch.float32 else q.dtype)
    h = torch.empty(B, NT, H, K, V, dtype=sdt, device=dev)
    dh = torch.empty(B, NT, H, K, V, dtype=sdt, device=dev)
    dS_in = torch.empty(B, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty(B, T, H, K, dtype=torch.float32, device=dev)

    dummy = h  # placeholder pointer for absent optional tensors (never read)
    wBK, wBV = cfg["walk_BK"], cfg["walk_BV"]
    wgrid = (triton.cdiv(K, wBK), triton.cdiv(V, wBV), B * H)
    _fwd_states_kernel[wgrid](
        k, v, g32, h0 if h0 is not None else dummy, h, T, NT,
        H=H, K=K, V=V, BT=BT, BK=wBK, BV=wBV, GATE=2, HAS_H0=h0 is not None, PREC=prec,
        num_warps=cfg["walk_warps"], num_stages=cfg["walk_stages"])
    _bwd_states_kernel[wgrid](
        q, g32, do, dht if dht is not None else dummy, dh,
        dS_in if dS_in is not None else dummy, T, NT, scale,
        H=H, K=K, V=V, BT=BT, BK=wBK, BV=wBV, GATE=2, HAS_DHT=dht is not None,
        STORE_DH0=dS_in is not None, PREC=prec, num_warps=cfg["walk_warps"],
        num_stages=cfg["walk_stages"])
    NK = triton.cdiv(K, cfg["dqk_BK"])
    fuse = bool(cfg["fuse_dv"]) and NK == 1
    a = None if fuse else torch.empty(NK, B, T, H, BT, dtype=torch.float32, device=dev)
    _dqkg_kernel[(NT, NK, B * H)](
        q, k, v, g32, h, do, dh, dq, dk, dv, dg, a if a is not None else dg,  # dg: unread
        T, NT, B * T, scale, H=H, K=K, V=V, BT=BT, BK=cfg["dqk_BK"], BV=cfg["dqk_BV"],
        FUSE_DV=fuse, STORE_A=not fuse, PREC=prec, num_warps=cfg["dqk_warps"],
        num_stages=cfg["dqk_stages"])
    if not fuse:
        _dv_kernel[(NT, triton.cdiv(V, cfg["dv_BV"]), B * H)](
            k, g32, do, dh, a, dv, T, NT, B * T, NK, scale,
            H=H, K=K, V=V, BT=BT, BK=cfg["dv_BK"], BV=cfg["dv_BV"], PREC=prec,
            num_warps=cfg["dv_warps"], num_stages=cfg["dv_stages"])
    return dq, dk, dv, dg, dS_in


def kernel_specs(K: int, V: int, dtype: torch.dtype = torch.bfloat16, *, B: int = 1,
                 H: int = 32, BT: int = CHUNK, tiles: dict | None = None,
                 has_h0: bool = True, has_dht: bool = True, fuse_dv: bool | None = None,
                 do_dtype: torch.dtype | None = None, device: str = "cpu") -> list:
    """The :class:`~forge_dist.runtime.programs.KernelSpec` of each launch that
    :func:`vector_decay_backward` makes for these dims with its default tiles (for AOT
    compilation and the shared-memory check; pointer types as that launch passes them).
    ``fuse_dv=False`` lists the unfused dq/dk/dg kernel and the dv kernel whatever K is;
    ``do_dtype`` defaults to ``dtype``; ``device`` sizes the walk tiles by its SM count
    ("cpu": a nominal 132-SM H100/H200)."""
    from ..runtime.programs import KernelSpec, tl_type

    cfg = default_tiles(B, H, K, V, torch.device(device), dtype=dtype, BT=BT)
    cfg.update(tiles or {})
    mod = "forge_dist.kernels"
    io = "*" + tl_type(dtype)
    st = "*" + tl_type(torch.float32 if dtype == torch.float32 else dtype)
    f32 = "*fp32"
    dot = "*" + tl_type(do_dtype or dtype)
    prec = "tf32x3"  # what dot_precision gives on a GPU (16-bit dots ignore it)
    dims = (("H", H), ("K", K), ("V", V), ("BT", BT))
    wtile = (("BK", cfg["walk_BK"]), ("BV", cfg["walk_BV"]), ("GATE", 2))
    specs = [
        KernelSpec(f"{mod}.scalar_backward:_fwd_states_kernel",
                   (("k", io), ("v", io), ("g", f32), ("h0", f32 if has_h0 else st), ("h", st),
                    ("T", "i32"), ("NT", "i32")),
                   dims + wtile + (("HAS_H0", has_h0), ("PREC", prec)),
                   cfg["walk_warps"], cfg["walk_stages"]),
        KernelSpec(f"{mod}.scalar_backward:_bwd_states_kernel",
                   (("q", io), ("g", f32), ("do", dot), ("dht", f32 if has_dht else st),
                    ("dh", st), ("dh0", f32 if has_h0 else st), ("T", "i32"), ("NT", "i32"),
                    ("scale", "fp32")),
                   dims + wtile + (("HAS_DHT", has_dht), ("STORE_DH0", has_h0),
                                   ("PREC", prec)),
                   cfg["walk_warps"], cfg["walk_stages"]),
    ]
    NK = triton.cdiv(K, cfg["dqk_BK"])
    fuse = (NK == 1 and cfg["fuse_dv"]) if fuse_dv is None else fuse_dv
    specs.append(KernelSpec(
        f"{mod}.vector_backward:_dqkg_kernel",
        (("q", io), ("k", io), ("v", io), ("g", f32), ("h", st), ("do", dot), ("dh", st),
         ("dq", io), ("dk", io), ("dv", io), ("dg", f32), ("a", f32), ("T", "i32"),
         ("NT", "i32"), ("NBT", "i32"), ("scale", "fp32")),
        dims + (("BK", cfg["dqk_BK"]), ("BV", cfg["dqk_BV"]), ("FUSE_DV", fuse),
                ("STORE_A", not fuse), ("PREC", prec)),
        cfg["dqk_warps"], cfg["dqk_stages"]))
    if not fuse:
        specs.append(KernelSpec(
            f"{mod}.vector_backward:_dv_kernel",
            (("k", io), ("g", f32), ("do", dot), ("dh", st), ("a", f32), ("dv", io),
             ("T", "i32"), ("NT", "i32"), ("NBT", "i32"), ("NA", "i32"), ("scale", "fp32")),
            dims + (("BK", cfg["dv_BK"]), ("BV", cfg["dv_BV"]), ("PREC", prec)),
            cfg["dv_warps"], cfg["dv_stages"]))
    return specs

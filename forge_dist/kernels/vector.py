"""Matrix state with vector (diagonal) decay: gla (``g [B, T, H, K]``), HGRN2.

The shared walker with ``GATE=2``, FUSED or DECOUPLED over segments (see :mod:`.scheduler`).
Inside a chunk the attention ``A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` (``j <= i``) cannot
be split into two bounded factors with one reference point for the whole chunk: at steep
gates one of them overflows.  ``_intra_kernel`` therefore cuts the chunk into sub-blocks of
``BC = 16`` rows:

* a block below the diagonal (rows in block I, columns in an earlier block J) takes as
  reference the row just before block I: ``q_i exp(G_i - G_ref)`` and ``k_j exp(G_ref - G_j)``
  are both decays ``<= 1`` (each exponent a direct sum of the gates in between), so one
  ``tl.dot`` forms the block and nothing can overflow; a factor underflows only where the
  product is below ``e^-87`` anyway;
* a diagonal block goes column by column, the decay ``sum_{j < s <= i} g_s`` summed directly
  and masked before the exponential (exact to a few ulps of itself).

Per token that is ``BC`` columns of elementwise work instead of ``BT`` (the whole chunk
column by column, the previous kernel), plus tensor-core work for the rest.  Without the
separate kernel (the interpreter, by default) the walker builds ``A`` column by column itself.
"""
from __future__ import annotations

import os

import torch

from ._common import (HAVE_TRITON, DecayAttentionWork, dot_precision, ensure, interpreting,
                      next_pow2, outputs_from_summary, sized_config, summarize, tl, triton, walk)

FUSED_CONFIG = {"BT": 32, "BV": 64, "num_warps": 4, "num_stages": 2}
INTRA_CONFIG = {"BC": 16, "num_warps": 4}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims."""
    return sized_config(FUSED_CONFIG, K)


if HAVE_TRITON:

    @triton.jit
    def _intra_kernel(q, k, g, a, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
        """grid ``(cdiv(T, BT), B * H)``; q, k, g [B, T, H, K]; a [B, T, H, BT] fp32 (unscaled).

        The chunk is cut into sub-blocks of ``BC`` rows (module docstring): blocks below the
        diagonal are one ``tl.dot`` each, both factors carrying a decay ``<= 1``; the
        diagonal blocks go column by column, the decay summed directly and masked before the
        exponential.  Blocks above the diagonal are stored as zeros (the walker reads all of A).
        """
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets pass 2**31 at long T
        bos = i_b * T
        t0 = i_t * BT
        DT = k.dtype.element_ty
        rows = tl.arange(0, BC)
        cols_k = tl.arange(0, BK)
        base_qk = (bos * H + i_h) * K
        for i_i in tl.static_range(BT // BC):
            r0 = t0 + i_i * BC
            p_q = tl.make_block_ptr(q + base_qk, (T, K), (H * K, 1), (r0, 0), (BC, BK), (1, 0))
            p_g = tl.make_block_ptr(g + base_qk, (T, K), (H * K, 1), (r0, 0), (BC, BK), (1, 0))
            b_q = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32)
            b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)  # padding: 0
            # diagonal block: A_rc = sum_k q_rk k_ck exp(sum_{c < s <= r} g_sk), c <= r
            b_A = tl.zeros([BC, BC], dtype=tl.float32)
            for c in tl.static_range(BC):
                m_c = (cols_k < K) & (r0 + c < T)
                k_c = tl.load(k + base_qk + (r0 + c).to(tl.int64) * (H * K) + cols_k, mask=m_c,
                              other=0.0).to(tl.float32)
                b_D = tl.cumsum(tl.where(rows[:, None] > c, b_g, 0.0), axis=0)
                b_e = tl.exp(tl.where(rows[:, None] >= c, b_D, float("-inf")))
                a_c = tl.sum(b_q * k_c[None, :] * b_e, axis=1)
                b_A = tl.where(rows[None, :] == c, a_c[:, None], b_A)
            p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1),
                                    (r0, i_i * BC), (BC, BC), (1, 0))
            tl.store(p_a, b_A, boundary_check=(0, 1))
            # blocks left of the diagonal, nearest first: the reference is the row before
            # r0, so q carries exp(G_r - G_ref) and k exp(G_ref - G_c), both <= 1
            b_qe = (b_q * tl.exp(tl.cumsum(b_g, axis=0))).to(DT)
            b_between = tl.zeros([BK], dtype=tl.float32)  # g summed over blocks in between
            for j in tl.static_range(i_i):
                c0 = r0 - (j + 1) * BC
                p_k = tl.make_block_ptr(k + base_qk, (T, K), (H * K, 1), (c0, 0), (BC, BK),
                                        (1, 0))
                p_gj = tl.make_block_ptr(g + base_qk, (T, K), (H * K, 1), (c0, 0), (BC, BK),
                                         (1, 0))
                b_gj = tl.load(p_gj, boundary_check=(0, 1)).to(tl.float32)
                b_after = tl.cumsum(b_gj, axis=0, reverse=True) - b_gj  # sum_{s > c} in block
                b_ke = (tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
                        * tl.exp(b_after + b_between[None, :])).to(DT)
                b_Aj = tl.dot(b_qe, tl.trans(b_ke), input_precision=PREC)
                p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1),
                                        (r0, i_i * BC - (j + 1) * BC), (BC, BC), (1, 0))
                tl.store(p_a, b_Aj, boundary_check=(0, 1))
                b_between += tl.sum(b_gj, axis=0)
            for j in tl.static_range(i_i + 1, BT // BC):  # above the diagonal
                p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1),
                                        (r0, j * BC), (BC, BC), (1, 0))
                tl.store(p_a, tl.zeros([BC, BC], dtype=tl.float32), boundary_check=(0, 1))


def use_intra_kernel() -> bool:
    """The separate intra-chunk kernel runs on GPUs; under the interpreter only when
    ``FORGE_DIST_GLA_INTRA=1`` (its unrolled column loop is slow to interpret)."""
    if interpreting():
        return os.environ.get("FORGE_DIST_GLA_INTRA", "0") == "1"
    return True


def intra_attention(q, k, g, BT: int):
    """``A [B, T, H, BT]`` fp32: in-chunk vector-decay attention (rows of each chunk)."""
    B, T, H, K = q.shape
    a = torch.empty(B, T, H, BT, dtype=torch.float32, device=q.device)
    _intra_kernel[(triton.cdiv(T, BT), B * H)](
        q, k, g, a, T, H=H, K=K, BT=BT, BK=next_pow2(K), BC=min(INTRA_CONFIG["BC"], BT),
        PREC=dot_precision(q.dtype), num_warps=INTRA_CONFIG["num_warps"])
    return a


class VectorDecayWork(DecayAttentionWork):
    """gla segment: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``."""

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        a = intra_attention(q, k, g, cfg["BT"]) if use_intra_kernel() else None
        if self.segments is not None:  # the summary ran: only the output walks remain
            return outputs_from_summary(self.segments, k, v, q=q, g=g, gate=2, S_in=S_in,
                                        scale=self.scale, out_dtype=self.out_dtype, cfg=cfg,
                                        prec=dot_precision(self.in_dtype), a=a)
        n_seg = self._schedule(k, v, cfg, gate_elems=k.shape[-1])
        return walk(k, v, q=q, g=g, gate=2, h0=S_in, scale=self.scale, out_dtype=self.out_dtype,
                    cfg=cfg, prec=dot_precision(self.in_dtype), a=a, n_seg=n_seg)

    def _summary_segments(self) -> int:
        k, v = self.tensors[1], self.tensors[2]
        return self._schedule(k, v, fused_config(k.shape[-1], v.shape[-1]),
                              gate_elems=k.shape[-1], with_summary=True)

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        n_seg = self._summary_segments()
        self.segments = summarize(k, v, g=g, gate=2, cfg=cfg, prec=dot_precision(self.in_dtype),
                                  n_seg=n_seg)
        M = self.segments.total_log_decay().exp() if need_M else None  # [B, H, K]
        return self.segments.delta, M

    @staticmethod
    def chunk_backward(*args):
        """The Triton chunk backward (:func:`.vector_backward.vector_decay_backward`)."""
        from .vector_backward import vector_decay_backward

        return vector_decay_backward(*args)

"""Matrix state with vector (diagonal) decay: gla (``g [B, T, H, K]``), HGRN2.

The shared walker with ``GATE=2``, FUSED or DECOUPLED over segments (see :mod:`.scheduler`).  Inside a chunk the attention
``A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` cannot be split into two bounded factors without
a reference point, and any reference point overflows for steep gates; the walker therefore
builds it column by column with the difference masked before the exponential, which keeps
the chunk short (``BT = 16``).
"""
from __future__ import annotations

import os

import torch

from ._common import (HAVE_TRITON, DecayAttentionWork, dot_precision, ensure, interpreting,
                      next_pow2, outputs_from_summary, sized_config, summarize, tl, triton, walk)

FUSED_CONFIG = {"BT": 32, "BV": 64, "num_warps": 4, "num_stages": 2}
INTRA_CONFIG = {"num_warps": 4}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims."""
    return sized_config(FUSED_CONFIG, K)


if HAVE_TRITON:

    @triton.jit
    def _intra_kernel(q, k, g, a, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr):
        """grid ``(cdiv(T, BT), B * H)``; q, k, g [B, T, H, K]; a [B, T, H, BT] fp32 (unscaled)."""
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets pass 2**31 at long T
        bos = i_b * T
        t0 = i_t * BT
        rows = tl.arange(0, BT)
        cols_k = tl.arange(0, BK)
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1)).to(tl.float32)
        b_G = tl.cumsum(tl.load(p_g, boundary_check=(0, 1)).to(tl.float32), axis=0)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for j in tl.static_range(BT):
            m_j = (cols_k < K) & (t0 + j < T)
            k_j = tl.load(k + ((bos + t0 + j) * H + i_h) * K + cols_k, mask=m_j, other=0.0).to(tl.float32)
            G_j = tl.sum(tl.where((rows == j)[:, None], b_G, 0.0), axis=0)
            e = tl.exp(tl.where(rows[:, None] >= j, b_G - G_j[None, :], float("-inf")))
            a_j = tl.sum(b_q * k_j[None, :] * e, axis=1)
            b_A = tl.where(rows[None, :] == j, a_j[:, None], b_A)
        p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
        tl.store(p_a, b_A, boundary_check=(0, 1))


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
    _intra_kernel[(triton.cdiv(T, BT), B * H)](q, k, g, a, T, H=H, K=K, BT=BT, BK=next_pow2(K),
                                               num_warps=INTRA_CONFIG["num_warps"])
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

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        n_seg = self._schedule(k, v, cfg, gate_elems=k.shape[-1], with_summary=True)
        self.segments = summarize(k, v, g=g, gate=2, cfg=cfg, prec=dot_precision(self.in_dtype),
                                  n_seg=n_seg)
        M = self.segments.total_log_decay().exp() if need_M else None  # [B, H, K]
        return self.segments.delta, M

    @staticmethod
    def chunk_backward(*args):
        """The Triton chunk backward (:func:`.vector_backward.vector_decay_backward`)."""
        from .vector_backward import vector_decay_backward

        return vector_decay_backward(*args)

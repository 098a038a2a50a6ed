"""Matrix state with vector (diagonal) decay: gla (``g [B, T, H, K]``), HGRN2.

FUSED only: the shared walker with ``GATE=2``.  Inside a chunk the attention
``A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` cannot be split into two bounded factors without
a reference point, and any reference point overflows for steep gates; the walker therefore
builds it column by column with the difference masked before the exponential, which keeps
the chunk short (``BT = 16``).
"""
from __future__ import annotations

import torch

from ._common import TritonWork, dot_precision, ensure, next_pow2, walk
from ..variants import decay_attention

FUSED_CONFIG = {"BT": 16, "BV": 64, "num_warps": 4, "num_stages": 2}


def fused_config(K: int, V: int) -> dict:
    cfg = dict(FUSED_CONFIG)
    if next_pow2(K) >= 256:
        cfg.update(BV=32, num_warps=8)
    return cfg


class VectorDecayWork(TritonWork):
    """gla segment: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``."""

    names = ("q", "k", "v", "g")

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g = (ensure(t) for t in tensors)
        self.execution, self.execution_reason = "fused", "decoupled not built for this pattern"
        return walk(k, v, q=q, g=g, gate=2, h0=S_in, scale=self.scale, out_dtype=self.out_dtype,
                    cfg=fused_config(k.shape[-1], v.shape[-1]), prec=dot_precision(self.in_dtype))

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        _, delta = walk(k, v, g=g, gate=2, cfg=fused_config(k.shape[-1], v.shape[-1]),
                        prec=dot_precision(self.in_dtype))
        M = g.to(torch.float32).sum(dim=1).exp() if need_M else None  # [B, H, K]
        return delta, M

    def _summary_torch(self, tensors, need_M):
        q, k, v, g = tensors
        return decay_attention.summarize(q, k, v, g, self.scale, need_transition=need_M)

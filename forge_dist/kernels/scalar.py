"""Matrix state with scalar (or no) decay: linear_attn (no gate) and simple_gla (``g [B,T,H]``).

FUSED: the shared walker (:mod:`._common`), one program per ``(batch, head, V tile)``.
DECOUPLED (paper appendix B.2), three launches:

1. ``_chunk_state_kernel``  per chunk in parallel: ``dS_c = (k * exp(G_C - G))^T v`` into
   ``h [B, H, NT, K, V]`` fp32;
2. ``_chunk_scan_kernel``   per ``(batch, head, V tile)``: ``S_{c+1} = exp(G_C) S_c + dS_c``,
   overwriting ``h`` in place with each chunk's *start* state;
3. ``_chunk_output_kernel`` per chunk in parallel: ``o = scale ((q exp(G)) S_c + A v)``.
"""
from __future__ import annotations


import torch

from . import scheduler
from ._common import (HAVE_TRITON, dot_precision, ensure, next_pow2, scalar_gate_chunk,
                      sized_config, tl, triton, TritonWork, walk)
from ..variants import decay_attention

# Tile configs for this pattern (one place).  BV trades parallelism (B*H*V/BV programs)
# against re-reading q, k once per V tile.
FUSED_CONFIG = {"BT": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
DECOUPLED_CONFIG = {"BT": 64, "BV": 64, "num_warps": 4, "num_stages": 2}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims."""
    return sized_config(FUSED_CONFIG, K)


def decoupled_config(K: int, V: int) -> dict:
    """The decoupled kernels' tiles for these head dims."""
    return sized_config(DECOUPLED_CONFIG, K)


if HAVE_TRITON:

    @triton.jit
    def _chunk_state_kernel(k, v, g, h, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            GATE: tl.constexpr, PREC: tl.constexpr):
        """Phase 1; grid ``(cdiv(V, BV), NT, B * H)``; h ``[B, H, NT, K, V]`` fp32."""
        i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = i_bh // H, i_bh % H
        NT = tl.cdiv(T, BT)
        bos = i_b * T
        t0 = i_t * BT
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        if GATE == 1:
            b_G, b_GC = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_k = (b_k.to(tl.float32) * tl.exp(b_GC - b_G)[:, None]).to(b_v.dtype)
        b_dS = tl.dot(tl.trans(b_k), b_v, input_precision=PREC)
        p_h = tl.make_block_ptr(h + (i_bh * NT + i_t) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_h, b_dS, boundary_check=(0, 1))

    @triton.jit
    def _chunk_scan_kernel(g, h, h0, ht, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           GATE: tl.constexpr, HAS_H0: tl.constexpr):
        """Phase 2; grid ``(cdiv(V, BV), B * H)``; h in place: chunk sums -> chunk starts."""
        i_v, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        NT = tl.cdiv(T, BT)
        bos = i_b * T
        if HAS_H0:
            p0 = tl.make_block_ptr(h0 + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
            b_S = tl.load(p0, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_S = tl.zeros([BK, BV], dtype=tl.float32)
        for t0 in range(0, T, BT):
            i_t = t0 // BT
            p_h = tl.make_block_ptr(h + (i_bh * NT + i_t) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
            b_dS = tl.load(p_h, boundary_check=(0, 1))
            tl.store(p_h, b_S, boundary_check=(0, 1))
            if GATE == 1:
                o_g = (i_t * BT) + tl.arange(0, BT)  # per-token scalars (stride H)
                p_g = g + (bos + o_g) * H + i_h
                b_GC = tl.sum(tl.load(p_g, mask=o_g < T, other=0.0).to(tl.float32), axis=0)
                b_S = b_S * tl.exp(b_GC)
            b_S = b_S + b_dS
        p_ht = tl.make_block_ptr(ht + i_bh * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_ht, b_S, boundary_check=(0, 1))

    @triton.jit
    def _chunk_output_kernel(q, k, v, g, h, o, T, scale, H: tl.constexpr, K: tl.constexpr,
                             V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
        """Phase 3; grid ``(cdiv(V, BV), NT, B * H)``."""
        i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = i_bh // H, i_bh % H
        NT = tl.cdiv(T, BT)
        bos = i_b * T
        t0 = i_t * BT
        rows = tl.arange(0, BT)
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_h = tl.make_block_ptr(h + (i_bh * NT + i_t) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_S = tl.load(p_h, boundary_check=(0, 1)).to(b_q.dtype)
        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        causal = rows[:, None] >= rows[None, :]
        if GATE == 1:
            b_G, _ = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_A = b_A * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
            b_qg = (b_q.to(tl.float32) * tl.exp(b_G)[:, None]).to(b_q.dtype)
        else:
            b_A = tl.where(causal, b_A, 0.0)
            b_qg = b_q
        b_o = tl.dot(b_qg, b_S, input_precision=PREC)
        b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PREC)
        p_o = tl.make_block_ptr(o + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_o, (b_o * scale).to(p_o.dtype.element_ty), boundary_check=(0, 1))


def decoupled_forward(q, k, v, g, h0, *, scale: float, out_dtype, cfg: dict, prec: str):
    """Three-phase forward; returns ``(o [B, T, H, V], final state [B, H, K, V] fp32)``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT, BK = cfg["BT"], next_pow2(K)
    BV = min(cfg["BV"], next_pow2(V))
    NT = triton.cdiv(T, BT)
    NV = triton.cdiv(V, BV)
    gate = 0 if g is None else 1
    gg = g if g is not None else k
    h = torch.empty(B, H, NT, K, V, dtype=torch.float32, device=k.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    o = torch.empty(B, T, H, V, dtype=out_dtype, device=k.device)
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _chunk_state_kernel[(NV, NT, B * H)](k, v, gg, h, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                                         GATE=gate, PREC=prec, **opts)
    if h0 is not None:
        h0 = h0.to(torch.float32).contiguous()
    _chunk_scan_kernel[(NV, B * H)](gg, h, h0 if h0 is not None else ht, ht, T, H=H, K=K, V=V,
                                    BT=BT, BK=BK, BV=BV, GATE=gate, HAS_H0=h0 is not None,
                                    **opts)
    _chunk_output_kernel[(NV, NT, B * H)](q, k, v, gg, h, o, T, scale, H=H, K=K, V=V, BT=BT,
                                          BK=BK, BV=BV, GATE=gate, PREC=prec, **opts)
    return o, ht


class ScalarDecayWork(TritonWork):
    """linear_attn / simple_gla segment: inputs ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``g [B, T, H]`` or ``None``."""

    names = ("q", "k", "v", "g")

    def _prec(self):
        return dot_precision(self.in_dtype)

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g = (ensure(t) for t in tensors)
        B, T, H, K = k.shape
        V = v.shape[-1]
        cfg_f = fused_config(K, V)
        strategy, self.execution_reason = scheduler.choose(
            B, T, H, K, V, cfg_f["BT"], cfg_f["BV"], elem_size=k.element_size(),
            request=self.execution_request)
        self.execution = strategy
        if strategy == scheduler.DECOUPLED:
            return decoupled_forward(q, k, v, g, S_in, scale=self.scale, out_dtype=self.out_dtype,
                                     cfg=decoupled_config(K, V), prec=self._prec())
        return walk(k, v, q=q, g=g, gate=0 if g is None else 1, h0=S_in, scale=self.scale,
                    out_dtype=self.out_dtype, cfg=cfg_f, prec=self._prec())

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        K, V = k.shape[-1], v.shape[-1]
        _, delta = walk(k, v, g=g, gate=0 if g is None else 1, cfg=fused_config(K, V),
                        prec=self._prec())
        M = None
        if need_M and g is not None:
            M = g.to(torch.float32).sum(dim=1).exp()  # [B, H]
        return delta, M

    def _summary_torch(self, tensors, need_M):
        q, k, v, g = tensors
        return decay_attention.summarize(q, k, v, g, self.scale, need_transition=need_M)

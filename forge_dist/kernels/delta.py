"""Delta rule (dense transitions): gated_delta_rule (``g [B, T, H]``) and DeltaNet (``g=None``).

Two launches (see :mod:`forge_dist.variants.delta_rule` for the chunk equations):

1. ``_wy_kernel``, per chunk in parallel: the unit lower-triangular inverse
   ``Tm = (I + diag(b) Lmat)^{-1}`` by forward substitution (stable for aligned keys), then
   ``W = Tm diag(b exp(G)) K`` and ``U = Tm diag(b) V`` on tensor cores;
2. the shared fused walker with the WY correction ``v' = U - W S``.

The summary's dense transition ``M`` is the same walk started from ``S = I`` with ``U = 0``
(columns of the state are independent, so the walk carries the identity's columns), run
with fp32 operands and 3xTF32 dots: a bf16 chain of dense products drifts.
"""
from __future__ import annotations

import torch

from ._common import (HAVE_TRITON, dot_precision, ensure, next_pow2, scalar_gate_chunk,
                      sized_config, tl, triton, TritonWork, walk)
from ..variants import delta_rule

FUSED_CONFIG = {"BT": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
WY_CONFIG = {"BV": 64, "num_warps": 4, "num_stages": 1}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims."""
    return sized_config(FUSED_CONFIG, K)


if HAVE_TRITON:

    @triton.jit
    def _wy_kernel(k, v, g, beta, w, u, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, PREC: tl.constexpr):
        """grid ``(NT, B * H)``; k, w [B, T, H, K]; v, u [B, T, H, V]; g, beta [B, T, H]."""
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        bos = i_b * T
        t0 = i_t * BT
        rows = tl.arange(0, BT)
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        o_b = (t0) + tl.arange(0, BT)  # per-token scalars (stride H)
        p_b = beta + (bos + o_b) * H + i_h
        b_beta = tl.load(p_b, mask=o_b < T, other=0.0).to(tl.float32)
        strict = rows[:, None] > rows[None, :]
        b_L = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
        if GATE == 1:
            b_G, _ = scalar_gate_chunk(g, bos, t0, T, i_h, H, BT)
            b_L = b_L * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))
            b_kb = b_k.to(tl.float32) * (b_beta * tl.exp(b_G))[:, None]
        else:
            b_L = tl.where(strict, b_L, 0.0)
            b_kb = b_k.to(tl.float32) * b_beta[:, None]
        b_A = b_L * b_beta[:, None]
        # X = (I + A)^{-1} by forward substitution, row by row: X_i = e_i - A_i X (rows j < i
        # are final when row i is formed).  The product form (I - A)(I + A^2)(I + A^4)... is
        # exact in exact arithmetic but its powers of A reach binomial sizes when keys are
        # aligned (repeated tokens), and fp32 cancellation then returns garbage.
        b_X = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(0, BT):
            sel = rows == i
            a_i = tl.sum(tl.where(sel[:, None], b_A, 0.0), axis=0)
            x_i = tl.where(sel, 1.0, 0.0) - tl.sum(a_i[:, None] * b_X, axis=0)
            b_X = tl.where(sel[:, None], x_i[None, :], b_X)
        b_w = tl.dot(b_X, b_kb, input_precision=PREC)
        p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        tl.store(p_w, b_w.to(p_w.dtype.element_ty), boundary_check=(0, 1))
        for v0 in range(0, V, BV):
            p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, v0), (BT, BV), (1, 0))
            b_v = tl.load(p_v, boundary_check=(0, 1)).to(tl.float32) * b_beta[:, None]
            b_u = tl.dot(b_X, b_v, input_precision=PREC)
            p_u = tl.make_block_ptr(u + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, v0), (BT, BV), (1, 0))
            tl.store(p_u, b_u.to(p_u.dtype.element_ty), boundary_check=(0, 1))


def wy(k, v, g, beta, *, BT: int, prec: str, dtype):
    """``(W [B, T, H, K], U [B, T, H, V])`` in ``dtype``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    w = torch.empty(B, T, H, K, dtype=dtype, device=k.device)
    u = torch.empty(B, T, H, V, dtype=dtype, device=k.device)
    _wy_kernel[(triton.cdiv(T, BT), B * H)](
        k, v, g if g is not None else beta, beta, w, u, T, H=H, K=K, V=V, BT=BT,
        BK=next_pow2(K), BV=min(WY_CONFIG["BV"], next_pow2(V)),
        GATE=0 if g is None else 1, PREC=prec, num_warps=WY_CONFIG["num_warps"],
        num_stages=WY_CONFIG["num_stages"])
    return w, u


class DeltaRuleWork(TritonWork):
    """gated_delta_rule segment: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``g [B, T, H]`` or ``None``, ``beta [B, T, H]``."""

    names = ("q", "k", "v", "g", "beta")

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        self.execution, self.execution_reason = "fused", "decoupled not built for this pattern"
        # bf16 inputs: W/U in bf16 and TF32 for the WY products; fp32 inputs stay fp32 (3xTF32)
        low = k.dtype in (torch.float16, torch.bfloat16)
        wy_prec = "tf32" if low and dot_precision(k.dtype) != "ieee" else dot_precision(k.dtype)
        w, u = wy(k, v, g, beta, BT=cfg["BT"], prec=wy_prec, dtype=k.dtype)
        return walk(k, u, q=q, g=g, gate=0 if g is None else 1, w=w, h0=S_in, scale=self.scale,
                    out_dtype=self.out_dtype, cfg=cfg, prec=dot_precision(k.dtype))

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g, beta = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        prec = dot_precision(torch.float32)
        k32, v32 = k.to(torch.float32), v.to(torch.float32)
        w, u = wy(k32, v32, g, beta, BT=cfg["BT"], prec=prec, dtype=torch.float32)
        gate = 0 if g is None else 1
        _, delta = walk(k32, u, g=g, gate=gate, w=w, cfg=cfg, prec=prec)
        M = None
        if need_M:
            B, T, H, K = k.shape
            eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(B, H, K, K)
            _, M = walk(k32, None, V=K, g=g, gate=gate, w=w, h0=eye, cfg=cfg, prec=prec)
        return delta, M

    def _summary_torch(self, tensors, need_M):
        q, k, v, g, beta = tensors
        return delta_rule.summarize(q, k, v, g, beta, self.scale, need_transition=need_M)

"""Backward of a shard summary with scalar, per-channel or no decay, as one Triton kernel.

The summary of a shard is ``delta = sum_t diag(c_t) k_t v_t^T`` and ``M = exp(sum_t g_t)``,
with ``c_t = exp(r_t)`` and ``r_t = g_{t+1} + ... + g_T`` the decay after token ``t`` (a
number per head for ``g [B, T, H]``, per key channel for ``g [B, T, H, K]``, ``c = 1``
without ``g``).  Its gradients (see :func:`decay_summary_backward`, the PyTorch
form of the same closed form)::

    dk_t = c_t * (ddelta v_t),   dv_t = ddelta^T (c_t * k_t),
    dg_s = sum_{t < s} k_t . dk_t  (per channel for vector gates)  +  dM * M

The PyTorch form materialises fp32 copies of ``k``, ``v`` and the products: about a dozen
full passes over ``[B, T, H, K]`` fp32 tensors, ~10 ms at 4 x 32K tokens x 32 heads of 128
on an H200, which made a rank's forward+backward 3x its single-GPU time.  Here one program
per ``(chunk of BT tokens, batch x head)`` reads ``k, v`` once in their own dtype and writes
``dk, dv`` in theirs, with ``ddelta`` in fp32 on tensor cores (3xTF32).  Two small PyTorch
steps carry what crosses chunks: the decay of the later chunks (a reverse cumulative sum of
the chunk totals of ``g``, before the kernel) and the ``k . dk`` sums of the earlier chunks
(a cumulative sum of the per-chunk totals the kernel writes, added to ``dg`` after it).
Both are shifted sums of their own terms, never differences of two long sums.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from .compat import HAVE_TRITON, dot_precision, interpreting, next_pow2, tl, triton
from .ir import KernelSpec, tl_type
from .tiles import reset_floor

#: Tokens per program.
CHUNK = 64
#: Widest V tile (the fp32 ddelta tiles and their 3xTF32 splits live in shared memory; with
#: bf16 operands 32 was also the fastest of 32 / 64 / 128, results/summary_backward_*_sweep).
BV_MAX = 32

if HAVE_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _decay_summary_bwd_kernel(k, v, g, r_after, ddelta, dk, dv, dg_local, p_chunk, T,
                                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                  GATE: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                                  INTERP: tl.constexpr = False, ACC: tl.constexpr = False):
        """``GATE``: 0 no decay, 1 scalar ``g [B, T, H]``, 2 per channel ``g [B, T, H, K]``.
        ``LOWP``: ``ddelta`` arrives in ``k``'s dtype (bf16) and the two products over ``V``
        run on bf16 operands with fp32 accumulation; otherwise fp32 operands at ``PREC``.
        ``r_after [B, NT, H(, K)]``: decay of the chunks after this one.  Writes ``dk, dv``,
        ``dg_local`` (the in-chunk part of ``dg``, fp32) and ``p_chunk [B, NT, H(, K)]``
        (this chunk's sum of ``k . dk``)."""
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        NT = tl.cdiv(T, BT)
        bos = i_b.to(tl.int64) * T
        o_t = i_t * BT + tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_t = o_t < T
        m_k = o_k < K
        rows = (bos + o_t).to(tl.int64) * H + i_h  # [BT] row index of (b, t, h)
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        # c_t = exp(r_t): the decay after t inside the chunk plus that of the later chunks
        # The in-chunk decay after t is a reverse cumsum of the gates shifted by one token
        # (loaded from row t + 1), not G_C - G_t: a steep g_t would cancel in the difference.
        o_i = tl.arange(0, BT)
        m_next = (o_t + 1 < T) & (o_i < BT - 1)
        if GATE == 1:
            b_gn = reset_floor(tl.load(g + rows + H, mask=m_next, other=0.0).to(tl.float32))
            r_next = tl.load(r_after + (i_b * NT + i_t) * H + i_h).to(tl.float32)
            b_c = tl.exp(tl.cumsum(b_gn, axis=0, reverse=True) + r_next)
            b_kc = b_k * b_c[:, None]
        elif GATE == 2:
            b_gn = reset_floor(tl.load(g + (rows + H)[:, None] * K + o_k[None, :],
                                       mask=m_next[:, None] & m_k[None, :],
                                       other=0.0).to(tl.float32))
            r_next = tl.load(r_after + ((i_b * NT + i_t) * H + i_h) * K + o_k, mask=m_k,
                             other=0.0).to(tl.float32)
            b_c = tl.exp(tl.cumsum(b_gn, axis=0, reverse=True) + r_next[None, :])
            b_kc = b_k * b_c
        else:
            b_kc = b_k
        b_kc = tl.where(m_tk, b_kc, 0.0)
        if LOWP:
            b_kc = b_kc.to(k.dtype.element_ty)
            if INTERP:
                b_kc = b_kc.to(tl.float32)
        acc = tl.zeros([BT, BK], dtype=tl.float32)  # ddelta v_t, summed over V tiles
        base_d = i_bh.to(tl.int64) * K * V
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.0)
            b_d = tl.load(ddelta + base_d + o_k[:, None] * V + o_v[None, :],
                          mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV]
            if INTERP or not LOWP:
                b_v = b_v.to(tl.float32)
                b_d = b_d.to(tl.float32)
            # transposed on chip: a strided re-read of the transposed tile from L2 used one
            # 4-byte word per 32-byte sector and was most of this kernel's time on an H200
            acc += tl.dot(b_v, tl.trans(b_d), input_precision=PREC)
            b_dv = tl.dot(b_kc, b_d, input_precision=PREC)
            p_dv = dv + rows[:, None] * V + o_v[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            if ACC:
                b_dv += tl.load(p_dv, mask=m_tv, other=0.0).to(tl.float32)
            tl.store(p_dv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
        if GATE == 1:
            b_dk = acc * b_c[:, None]
        elif GATE == 2:
            b_dk = acc * b_c
        else:
            b_dk = acc
        p_dk = dk + rows[:, None] * K + o_k[None, :]
        if ACC:  # b_dk itself stays this summary's own: the k . dk sums below need it
            tl.store(p_dk, (b_dk + tl.load(p_dk, mask=m_tk, other=0.0).to(tl.float32)).to(
                dk.dtype.element_ty), mask=m_tk)
        else:
            tl.store(p_dk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if GATE != 0:
            # k again (an L1/L2 hit) rather than an fp32 copy held live through the V loop,
            # which cost registers and a third of the scalar-gate kernel's speed
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk,
                          other=0.0).to(tl.float32)
        # sum over t < s inside the chunk as a masked sum (cumsum(p) - p would cancel)
        before_s = o_i[:, None] > o_i[None, :]  # [s, t]
        if GATE == 1:
            p = tl.sum(b_k * b_dk, axis=1)  # [BT]
            p = tl.where(m_t, p, 0.0)
            b_dgl = tl.sum(tl.where(before_s, p[None, :], 0.0), axis=1)
            if ACC:
                b_dgl += tl.load(dg_local + rows, mask=m_t, other=0.0)
            tl.store(dg_local + rows, b_dgl, mask=m_t)
            tl.store(p_chunk + (i_b * NT + i_t) * H + i_h, tl.sum(p, axis=0))
        elif GATE == 2:
            p = tl.where(m_tk, b_k * b_dk, 0.0)  # [BT, BK]
            b_lower = tl.where(before_s, 1.0, 0.0)
            b_dgl = tl.dot(b_lower, p, input_precision=PREC)
            if ACC:
                b_dgl += tl.load(dg_local + rows[:, None] * K + o_k[None, :], mask=m_tk,
                                 other=0.0)
            tl.store(dg_local + rows[:, None] * K + o_k[None, :], b_dgl, mask=m_tk)
            tl.store(p_chunk + ((i_b * NT + i_t) * H + i_h) * K + o_k, tl.sum(p, axis=0),
                     mask=m_k)


def _tiles(K: int, V: int, lowp: bool = False):
    """``(BK, BV, num_warps)``: all of K in one tile, V in tiles of at most ``BV_MAX``; 8
    warps only for fp32 operands at K = 256 (bf16 operands: 4 warps were the fastest).
    ``FORGE_DIST_SUMBWD_TILES="BV,warps"`` overrides (for tuning sweeps)."""
    BK = max(16, next_pow2(K))
    env = os.environ.get("FORGE_DIST_SUMBWD_TILES")
    if env:
        bv, warps = (int(x) for x in env.split(","))
        return BK, bv, warps
    return BK, min(BV_MAX, max(16, next_pow2(V))), 8 if BK >= 256 and not lowp else 4


def low_precision_operands(dtype: torch.dtype) -> bool:
    """bf16 ``k, v``: the products run on bf16 operands (``ddelta`` rounded to bf16, fp32
    accumulation), as a chunk kernel's backward does with its state gradient.  3xTF32 on
    fp32 operands cost ~6x the tensor-core time and made this kernel compute-bound (9.4 ms
    of a rank's 13 ms forward+backward at 4 x 32K tokens, ``results/sp_profile_*``).  fp16
    and fp32 keep fp32 operands (a state gradient may exceed fp16's range).
    ``FORGE_DIST_SUMBWD_LOWP=0`` keeps fp32 operands for bf16 too."""
    raw = os.environ.get("FORGE_DIST_SUMBWD_LOWP", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"FORGE_DIST_SUMBWD_LOWP: expected 0 or 1, got {raw!r}")
    return dtype == torch.bfloat16 and raw == "1"


def _chunk_totals(x: Tensor, T: int) -> Tensor:
    """``x [B, T, H(, K)]`` fp32 -> per-chunk sums ``[B, NT, H(, K)]``."""
    NT = -(-T // CHUNK)
    pad = NT * CHUNK - T
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], dim=1)
    return x.reshape((x.shape[0], NT, CHUNK) + tuple(x.shape[2:])).sum(dim=2)


def accumulable(grads, k: Tensor, v: Tensor, g: Optional[Tensor]) -> bool:
    """Whether ``grads = (dk, dv, dg)`` (the finish's) can take this backward's gradients
    in place: contiguous, of ``k``'s / ``v``'s shape and dtype, ``dg`` fp32 of ``g``'s
    shape (or both ``None``)."""
    if grads is None:
        return False
    dk, dv, dg = grads
    ok = all(isinstance(a, Tensor) and a.shape == b.shape and a.dtype == b.dtype
             and a.device == b.device and a.is_contiguous() for a, b in ((dk, k), (dv, v)))
    if g is None:
        return ok and dg is None
    return (ok and isinstance(dg, Tensor) and dg.shape == g.shape
            and dg.dtype == torch.float32 and dg.is_contiguous())


def decay_summary_backward(k: Tensor, v: Tensor, g: Optional[Tensor],
                           ddelta: Optional[Tensor], dM: Optional[Tensor]):
    """Gradients of a shard summary with scalar or per-channel decay, in closed form (no walk).

    ``delta = sum_t diag(c_t) k_t v_t^T`` with ``c_t = exp(r_t)``, ``r_t = g_{t+1} + ... + g_T``
    (the decay after token t; per key channel when ``g`` is ``[B, T, H, K]``, one number
    per head when ``g`` is ``[B, T, H]``, ``c = 1`` without ``g``), and ``M = exp(sum_t g_t)``::

        dk_t = c_t * (ddelta v_t),   dv_t = ddelta^T (c_t * k_t),
        dg_s = sum_{t < s} c_t * k_t * (ddelta v_t)  (summed over K for scalar gates)
               + dM * M                               (every s)

    ``r_t`` is a reverse cumulative sum shifted by one token and the sum over ``t < s`` a
    cumulative sum shifted by one token, never a difference of two sums (which cancels: at a
    steep ``g_t``, and an O(1) last term against an O(e^g) prefix).  Cost: two batched
    matmuls and a dozen fp32 passes: the reference and CPU form of
    :func:`decay_summary_backward_triton`, which the Triton works use.
    Args: k ``[B, T, H, K]``, v ``[B, T, H, V]``, ddelta ``[B, H, K, V]`` or
    ``None``, dM ``[B, H]`` / ``[B, H, K]`` or ``None``.  Returns ``(dk, dv, dg)`` in the
    dtypes of k, v, g (``dg`` ``None`` without ``g``).
    """
    f32 = torch.float32
    B, T, H, K = k.shape
    kf, vf = k.to(f32), v.to(f32)
    ddelta = (torch.zeros(B, H, K, v.shape[-1], dtype=f32, device=k.device) if ddelta is None
              else ddelta.to(f32))
    dk = torch.einsum("bthv,bhkv->bthk", vf, ddelta)  # ddelta v_t
    if g is None:
        return dk.to(k.dtype), torch.einsum("bthk,bhkv->bthv", kf, ddelta).to(v.dtype), None
    gf = g.to(f32) if g.dim() == 4 else g.to(f32)[..., None]  # [B, T, H, K or 1]
    zero = torch.zeros_like(gf[:, :1])
    after = torch.flip(torch.cumsum(torch.flip(gf, [1]), 1), [1])  # g_t + ... + g_T
    c = torch.cat([after[:, 1:], zero], 1).exp()  # exp(r_t)
    dk = c * dk
    dv = torch.einsum("bthk,bhkv->bthv", kf * c, ddelta)
    per_token = kf * dk if g.dim() == 4 else (kf * dk).sum(-1, keepdim=True)
    dg = torch.cat([zero, torch.cumsum(per_token, 1)[:, :-1]], 1)  # sum over t < s
    if dM is not None:
        total = gf.sum(dim=1)  # [B, H, K or 1]
        dg = dg + (dM.to(f32).reshape(total.shape) * total.exp())[:, None]
    if g.dim() == 3:
        dg = dg[..., 0]
    return dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype)


def decay_summary_backward_triton(k: Tensor, v: Tensor, g: Optional[Tensor],
                                  ddelta: Optional[Tensor], dM: Optional[Tensor],
                                  accumulate_into=None):
    """The closed-form summary backward on the GPU (or the interpreter).

    Args: ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``g`` ``[B, T, H]``, ``[B, T, H, K]`` or
    ``None``, ``ddelta [B, H, K, V]`` or ``None``, ``dM`` ``[B, H]`` / ``[B, H, K]`` or
    ``None``.  Returns ``(dk, dv, dg)`` in the dtypes of ``k, v, g`` (``dg`` ``None``
    without ``g``).

    ``accumulate_into``: ``(dk, dv, dg)`` that already hold other gradients of the same
    tensors (the finish's, see :func:`accumulable`): the kernel adds into them in place,
    which saves the separate ``+`` autograd would run over ``[B, T, H, K]``, and returns
    them.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    f32 = torch.float32
    if ddelta is None:
        ddelta = torch.zeros(B, H, K, V, dtype=f32, device=k.device)
    k, v = k.contiguous(), v.contiguous()
    lowp = low_precision_operands(k.dtype)
    ddelta = ddelta.to(k.dtype if lowp else f32).contiguous()
    NT = -(-T // CHUNK)
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    acc = accumulable(accumulate_into, k, v, g)
    if accumulate_into is not None and not acc:
        raise ValueError("decay_summary_backward_triton: accumulate_into does not match k, v, "
                         "g (see accumulable())")
    dk, dv = (accumulate_into[0], accumulate_into[1]) if acc else (torch.empty_like(k),
                                                                   torch.empty_like(v))
    if gate:
        gf = g.to(f32).contiguous()
        totals = _chunk_totals(gf, T)  # [B, NT, H(, K)]
        # decay of the chunks after chunk i: sum over j > i (shifted reverse cumsum)
        rev = torch.flip(torch.cumsum(torch.flip(totals, [1]), 1), [1])
        r_after = torch.cat([rev[:, 1:], torch.zeros_like(rev[:, :1])], 1).contiguous()
        dg_local = (accumulate_into[2] if acc
                    else torch.empty(gf.shape, dtype=f32, device=k.device))
        p_chunk = torch.empty(totals.shape, dtype=f32, device=k.device)
    else:
        gf = r_after = dg_local = p_chunk = ddelta  # unread placeholders
    BK, BV, warps = _tiles(K, V, lowp)
    _decay_summary_bwd_kernel[(NT, B * H)](
        k, v, gf, r_after, ddelta, dk, dv, dg_local, p_chunk, T, H=H, K=K, V=V, BT=CHUNK,
        BK=BK, BV=BV, GATE=gate, PREC=dot_precision(f32), LOWP=lowp, INTERP=interpreting(),
        ACC=acc, num_warps=warps)
    if not gate:
        return dk, dv, None
    # What each chunk's tokens add to dg: k . dk of the earlier chunks (a shifted cumsum of
    # the chunk totals) and dM * M.  Added in place, broadcast over the chunk's tokens: a
    # materialised [B, T, H, K] fp32 copy per term cost ~5 ms for gla at 4 x 32K tokens.
    per_chunk = torch.cat([torch.zeros_like(p_chunk[:, :1]), torch.cumsum(p_chunk, 1)[:, :-1]],
                          1)
    if dM is not None:
        total = totals.sum(dim=1)  # [B, H(, K)]
        per_chunk += (dM.to(f32).reshape(total.shape) * total.exp())[:, None]
    _add_per_chunk_(dg_local, per_chunk, T)
    return dk, dv, dg_local if acc else dg_local.to(g.dtype)


def _add_per_chunk_(x: Tensor, per_chunk: Tensor, T: int) -> None:
    """``x [B, T, ...] += per_chunk [B, NT, ...]``, each chunk's value on its CHUNK tokens."""
    full = T // CHUNK
    if full:
        x[:, :full * CHUNK].unflatten(1, (full, CHUNK)).add_(per_chunk[:, :full, None])
    if T % CHUNK:
        x[:, full * CHUNK:].add_(per_chunk[:, full:full + 1])


def kernel_specs(K: int = 128, V: int = 128, dtype: torch.dtype = torch.bfloat16, *,
                 H: int = 32) -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of each gate kind's launch at
    these dims (for AOT compilation and the resource report)."""
    io, f32 = "*" + tl_type(dtype), "*fp32"
    lowp = low_precision_operands(dtype)
    BK, BV, warps = _tiles(K, V, lowp)
    sig = (("k", io), ("v", io), ("g", f32), ("r_after", f32), ("ddelta", io if lowp else f32),
           ("dk", io), ("dv", io), ("dg_local", f32), ("p_chunk", f32), ("T", "i32"))
    return [KernelSpec("forge_dist.kernels.summary_backward:_decay_summary_bwd_kernel", sig,
                       (("H", H), ("K", K), ("V", V), ("BT", CHUNK), ("BK", BK), ("BV", BV),
                        ("GATE", gate), ("PREC", "tf32x3"), ("LOWP", lowp), ("INTERP", False),
                        ("ACC", False)), warps, 1)
            for gate in (0, 1, 2)]

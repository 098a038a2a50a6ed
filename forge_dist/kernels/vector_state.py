"""Vector state (HGRN): ``h_t = exp(g_t) * h_{t-1} + x_t``, ``o_t = h_t``; x, g ``[B, T, D]``.

FUSED: one program per ``(batch, D tile)`` walks chunks of ``BT`` tokens with ``h`` on chip;
inside a chunk the affine maps ``(g, x)`` are combined by a parallel associative scan
(``(G1, X1) then (G2, X2) = (G1 + G2, exp(G2) X1 + X2)``, exponents are sums of log decays,
never positive), then ``o = exp(G) h + X`` and ``h`` moves to the chunk's last row.
DECOUPLED cuts the sequence into segments (summaries in parallel, a scan over segments, outputs
in parallel from each segment's incoming state), as the matrix patterns do.
The runtime stores the state as ``[B, 1, D, 1]``; M is ``[B, 1, D]``.
"""
from __future__ import annotations

import torch

from . import scheduler
from ._common import (HAVE_TRITON, SegmentStates, TritonWork, ensure, triton, tl,
                      use_autotune)
from ..variants import vector_state

FUSED_CONFIG = {"BT": 64, "BD": 32, "num_warps": 4, "num_stages": 2}


if HAVE_TRITON:

    @triton.jit
    def _affine(g1, x1, g2, x2):
        return g1 + g2, x1 * tl.exp(g2) + x2

    @triton.jit
    def _hgrn_kernel(x, g, h0, o, ht, gt, T, SEG, D: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, HAS_H0: tl.constexpr, STORE_O: tl.constexpr,
                     STORE_GT: tl.constexpr = False, HAS_SIN: tl.constexpr = False,
                     s_in=None, cg=None, HT_LAST: tl.constexpr = False):
        """grid ``(cdiv(D, BD), B, NSEG)``; x, g, o [B, T, D]; h0, ht [NSEG, B, D] fp32 (each
        segment of SEG tokens: its start and end state); gt [NSEG, B, D] fp32 the segment's
        summed log decay (STORE_GT).  HAS_SIN: ``s_in [B, D]`` enters the whole walk, each
        segment starts from ``h0 + exp(cg) * s_in`` (``cg [NSEG + 1, B, D]`` from the scan);
        HT_LAST: only the last segment stores its end state, into ``ht [B, D]``."""
        i_d, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = i_s * tl.num_programs(1) + i_b
        cols = i_d * BD + tl.arange(0, BD)
        rows = tl.arange(0, BT)
        cmask = cols < D
        if HAS_H0:
            b_h = tl.load(h0 + slot * D + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            b_h = tl.zeros([BD], dtype=tl.float32)
        if HAS_SIN:
            b_si = tl.load(s_in + i_b * D + cols, mask=cmask, other=0.0).to(tl.float32)
            b_h += tl.exp(tl.load(cg + slot * D + cols, mask=cmask, other=0.0)) * b_si
        b_gt = tl.zeros([BD], dtype=tl.float32)
        t_lo = i_s * SEG
        for t0 in range(t_lo, tl.minimum(T, t_lo + SEG), BT):
            p_x = tl.make_block_ptr(x + i_b * T * D, (T, D), (D, 1), (t0, i_d * BD), (BT, BD), (1, 0))
            p_g = tl.make_block_ptr(g + i_b * T * D, (T, D), (D, 1), (t0, i_d * BD), (BT, BD), (1, 0))
            b_x = tl.load(p_x, boundary_check=(0, 1)).to(tl.float32)
            b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
            b_G, b_X = tl.associative_scan((b_g, b_x), axis=0, combine_fn=_affine)
            b_o = tl.exp(b_G) * b_h[None, :] + b_X
            if STORE_O:
                p_o = tl.make_block_ptr(o + i_b * T * D, (T, D), (D, 1), (t0, i_d * BD), (BT, BD), (1, 0))
                tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
            # padded rows carry g = 0, x = 0: the last row holds the last real token's state
            b_h = tl.sum(tl.where((rows == BT - 1)[:, None], b_o, 0.0), axis=0)
            if STORE_GT:
                b_gt += tl.sum(b_g, axis=0)
        if HT_LAST:
            if i_s == tl.num_programs(2) - 1:
                tl.store(ht + i_b * D + cols, b_h, mask=cmask)
        else:
            tl.store(ht + slot * D + cols, b_h, mask=cmask)
        if STORE_GT:
            tl.store(gt + slot * D + cols, b_gt, mask=cmask)

    @triton.jit
    def _hgrn_scan_kernel(hs, gt, h0, ht, NSEG, D: tl.constexpr, BD: tl.constexpr,
                          HAS_H0: tl.constexpr, STORE_CG: tl.constexpr = False, cg=None):
        """grid ``(cdiv(D, BD), B)``: segment end states (zero start) -> segment start states
        in place; ht [B, D] the final state; STORE_CG: ``cg [NSEG + 1, B, D]`` the log decay
        from the start to each segment's start (row NSEG: the total)."""
        i_d, i_b = tl.program_id(0), tl.program_id(1)
        NB = tl.num_programs(1)
        cols = i_d * BD + tl.arange(0, BD)
        cmask = cols < D
        if HAS_H0:
            b_h = tl.load(h0 + i_b * D + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            b_h = tl.zeros([BD], dtype=tl.float32)
        b_c = tl.zeros([BD], dtype=tl.float32)
        for i_s in range(0, NSEG):
            off = (i_s * NB + i_b) * D + cols
            b_d = tl.load(hs + off, mask=cmask, other=0.0)
            tl.store(hs + off, b_h, mask=cmask)
            b_g = tl.load(gt + off, mask=cmask, other=0.0)
            if STORE_CG:
                tl.store(cg + off, b_c, mask=cmask)
                b_c += b_g
            b_h = b_h * tl.exp(b_g) + b_d
        tl.store(ht + i_b * D + cols, b_h, mask=cmask)
        if STORE_CG:
            tl.store(cg + (NSEG * NB + i_b) * D + cols, b_c, mask=cmask)


if HAVE_TRITON:
    _hgrn_tuned = triton.autotune(
        configs=[triton.Config({"BT": bt, "BD": bd}, num_warps=nw)
                 for bt in (32, 64, 128) for bd in (16, 32, 64) for nw in (2, 4)
                 if bt * bd <= 4096],
        key=["D", "HAS_H0", "STORE_O", "STORE_GT"])(_hgrn_kernel)


def hgrn_forward(x, g, h0, *, out_dtype, store_o: bool = True, n_seg: int = 1):
    """``(o [B, T, D] or None, final [B, D] fp32)``; ``h0 [B, D]`` or ``None``.

    ``n_seg > 1``: DECOUPLED over segments (summaries in parallel, a scan over segments,
    outputs in parallel), as the matrix patterns' ``walk``.
    """
    from ._common import segment_length

    B, T, D = x.shape
    cfg = FUSED_CONFIG
    o = torch.empty(B, T, D, dtype=out_dtype, device=x.device) if store_o else None
    ht = torch.empty(B, D, dtype=torch.float32, device=x.device)
    if h0 is not None:
        h0 = h0.reshape(B, D).to(torch.float32).contiguous()
    if use_autotune() and n_seg == 1:
        args = (x, g, h0 if h0 is not None else ht, o if o is not None else ht, ht, ht, T, T)
        _hgrn_tuned[lambda meta: (triton.cdiv(D, meta["BD"]), B, 1)](
            *args, D=D, HAS_H0=h0 is not None, STORE_O=store_o)
        return o, ht
    seg = segment_length(T, cfg["BT"], n_seg)
    n_seg = max(1, -(-T // seg))
    grid = (triton.cdiv(D, cfg["BD"]), B, n_seg)
    opts = dict(D=D, BT=cfg["BT"], BD=cfg["BD"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    if n_seg == 1:
        _hgrn_kernel[grid](x, g, h0 if h0 is not None else ht, o if o is not None else ht, ht,
                           ht, T, seg, HAS_H0=h0 is not None, STORE_O=store_o, **opts)
        return o, ht
    hs = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    gt = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    _hgrn_kernel[grid](x, g, hs, hs, hs, gt, T, seg, HAS_H0=False, STORE_O=False,
                       STORE_GT=True, **opts)
    _hgrn_scan_kernel[grid[:2]](hs, gt, h0 if h0 is not None else ht, ht, n_seg, D=D,
                                BD=cfg["BD"], HAS_H0=h0 is not None,
                                num_warps=cfg["num_warps"])
    if store_o:
        _hgrn_kernel[grid](x, g, hs, o, hs, gt, T, seg, HAS_H0=True, STORE_O=True, **opts)
    return o, ht


def _hgrn_grid(x, n_seg: int):
    from ._common import segment_length

    B, T, D = x.shape
    cfg = FUSED_CONFIG
    seg = segment_length(T, cfg["BT"], n_seg)
    n_seg = max(1, -(-T // seg))
    opts = dict(D=D, BT=cfg["BT"], BD=cfg["BD"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    return seg, n_seg, (triton.cdiv(D, cfg["BD"]), B, n_seg), opts


def hgrn_summarize(x, g, *, n_seg: int = 1) -> SegmentStates:
    """The shard summary with its segment states kept (see ``_common.summarize``); states
    ``[B, D]``: ``delta`` from a zero start, ``decay_to [n_seg + 1, B, D]``."""
    B, T, D = x.shape
    seg, n_seg, grid, opts = _hgrn_grid(x, n_seg)
    hs = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    gt = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    _hgrn_kernel[grid](x, g, hs, hs, hs, gt, T, seg, HAS_H0=False, STORE_O=False,
                       STORE_GT=True, **opts)
    if n_seg == 1:
        return SegmentStates(1, seg, hs[0], None, torch.cat([torch.zeros_like(gt), gt]))
    delta = torch.empty(B, D, dtype=torch.float32, device=x.device)
    decay_to = torch.empty(n_seg + 1, B, D, dtype=torch.float32, device=x.device)
    _hgrn_scan_kernel[grid[:2]](hs, gt, delta, delta, n_seg, D=D, BD=opts["BD"], HAS_H0=False,
                                STORE_CG=True, cg=decay_to, num_warps=opts["num_warps"])
    return SegmentStates(n_seg, seg, delta, hs, decay_to)


def hgrn_outputs(summ: SegmentStates, x, g, S_in, *, out_dtype):
    """``(o [B, T, D], final [B, D])`` from a kept summary and the incoming state ``[B, D]``."""
    B, T, D = x.shape
    _, _, grid, opts = _hgrn_grid(x, summ.n_seg)
    o = torch.empty(B, T, D, dtype=out_dtype, device=x.device)
    ht = torch.empty(B, D, dtype=torch.float32, device=x.device)
    if S_in is not None:
        S_in = S_in.reshape(B, D).to(torch.float32).contiguous()
    if summ.n_seg == 1:
        _hgrn_kernel[grid](x, g, S_in if S_in is not None else ht, o, ht, ht, T, summ.seg,
                           HAS_H0=S_in is not None, STORE_O=True, **opts)
    else:
        extra = dict(HAS_SIN=True, s_in=S_in, cg=summ.decay_to) if S_in is not None else {}
        _hgrn_kernel[grid](x, g, summ.starts, o, ht, ht, T, summ.seg, HAS_H0=True,
                           STORE_O=True, HT_LAST=True, **extra, **opts)
    return o, ht


class VectorStateWork(TritonWork):
    """hgrn segment: ``x, g [B, T, D]``; states in the runtime layout ``[B, 1, D, 1]``."""

    names = ("x", "g")
    vector_state = True
    keeps_segments = True

    def __init__(self, variant, inputs, scale, need_transition, out_dtype=None, execution=None):
        super().__init__(variant, inputs, 1.0, need_transition, out_dtype, execution)

    def _finish_fwd(self, S_in, tensors):
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        if self.segments is not None:  # the summary ran: only the output walks remain
            o, ht = hgrn_outputs(self.segments, x, g, S_in, out_dtype=self.out_dtype)
            return o, ht.reshape(B, 1, D, 1)
        o, ht = hgrn_forward(x, g, S_in, out_dtype=self.out_dtype, n_seg=self._schedule_hgrn(x))
        return o, ht.reshape(B, 1, D, 1)

    def _summary_fwd(self, tensors, need_M):
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        self.segments = hgrn_summarize(x, g, n_seg=self._schedule_hgrn(x, with_summary=True))
        M = self.segments.total_log_decay().exp()[:, None] if need_M else None  # [B, 1, D]
        return self.segments.delta.reshape(B, 1, D, 1), M

    def _schedule_hgrn(self, x, with_summary: bool = False) -> int:
        B, T, D = x.shape
        s = scheduler.schedule_vector_state(B, T, D, FUSED_CONFIG["BT"], FUSED_CONFIG["BD"],
                                            elem_size=x.element_size(),
                                            request=self.execution_request,
                                            with_summary=with_summary)
        self.execution, self.execution_reason, self.n_seg = s.strategy, s.reason, s.n_seg
        return s.n_seg

    def _summary_torch(self, tensors, need_M):
        x, g = tensors
        return vector_state.summarize(x, g, need_transition=need_M)

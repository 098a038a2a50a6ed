"""Vector state (HGRN): ``h_t = exp(g_t) * h_{t-1} + x_t``, ``o_t = h_t``; x, g ``[B, T, D]``.

FUSED: one program per ``(batch, D tile)`` walks chunks of ``BT`` tokens with ``h`` on chip;
inside a chunk the affine maps ``(g, x)`` are combined by a parallel associative scan
(``(G1, X1) then (G2, X2) = (G1 + G2, exp(G2) X1 + X2)``, exponents are sums of log decays,
never positive), then ``o = exp(G) h + X`` and ``h`` moves to the chunk's last row.  The
default chunk is one token (``BT = 1``): the scan vanishes and each step is one exponential
and one multiply-add per channel while the loads of later tokens run ahead; at
``[1, 64K, 4096]`` bf16 on an H200 that is 0.73 ms against 2.6 ms for ``[64, 32]`` tiles
(``results/kernel_profile_hgrnsweep_*``, 87 % of the copy bandwidth for the two passes).
DECOUPLED cuts the sequence into segments (summaries in parallel, a scan over segments, outputs
in parallel from each segment's incoming state), as the matrix patterns do; with one token
per step the segments are what fills the GPU.
The runtime stores the state as ``[B, 1, D, 1]``; M is ``[B, 1, D]``.

Backward (:func:`hgrn_backward`).  With ``dh_t`` the gradient w.r.t. ``h_t``::

    dh_t = do_t + exp(g_{t+1}) dh_{t+1}      (dh_{T-1} = do_{T-1} + dht)
    dx_t = dh_t,   dg_t = dh_t exp(g_t) h_{t-1},   dS_in = exp(g_0) dh_0

``dg`` is a product of three factors, so it keeps its relative precision at any gate (no
difference of large terms).  The states ``h`` are the forward's outputs, which the op's
autograd keeps (no recompute; a caller without them recomputes them with the forward
kernels, in x's dtype); each program walks its tokens from the last, a block per step,
carrying ``exp(g) dh`` of the token to its right.  That carry is affine in the carry entering
from the right, so the backward has the forward's DECOUPLED schedule too: each segment's
outgoing carry from a zero start (segments in parallel), the forward's segment scan run over
the segments in reverse order, then every segment's walk from its incoming carry.
"""
from __future__ import annotations

import functools

import torch

from typing import Any, Dict, Optional

from . import scheduler
from .compat import HAVE_TRITON, cdiv, ensure, tl, triton
from .ir import Buffer, Launch, Program, cdiv, run_launch
from .tiles import mapped_tile
from .walker import SegmentStates, use_autotune
from .walker_launches import map_consts, segment_length
from .work import TritonWork
from ..variants import vector_state

# Measured on H200, [1, T, 4096] bf16 (results/kernel_profile_hgrn*_2026-11-24): 8 tokens
# per step, 256 channels, one warp (the block's rows stay in one thread, so the scan needs no
# shuffles): 67 / 142 / 665 us forward at T = 1K / 4K / 64K against 121 / 156 / 806 us
# with one token per step (each step waited on its own loads); two warps split the rows
# and took 1.6 ms at 64K.
FUSED_CONFIG = {"BT": 8, "BD": 256, "num_warps": 1, "num_stages": 2}


if HAVE_TRITON:

    @triton.jit
    def _affine(a1, x1, a2, x2):
        """Composition of ``y -> a1 y + x1`` then ``y -> a2 y + x2`` (multipliers, not log
        decays: one exponential per element, none per combine)."""
        return a1 * a2, x1 * a2 + x2

    @triton.jit
    def _hgrn_kernel(x, g, h0, o, ht, gt, T, SEG, D: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, HAS_H0: tl.constexpr, STORE_O: tl.constexpr,
                     STORE_GT: tl.constexpr = False, HAS_SIN: tl.constexpr = False,
                     s_in=None, cg=None, HT_LAST: tl.constexpr = False,
                     X_MAP: tl.constexpr = None, G_MAP: tl.constexpr = None):
        """grid ``(cdiv(D, BD), B, NSEG)``; x, g, o [B, T, D]; h0, ht [NSEG, B, D] fp32 (each
        segment of SEG tokens, a multiple of BT: its start and end state); gt [NSEG, B, D]
        fp32 the segment's summed log decay (STORE_GT).  HAS_SIN: ``s_in [B, D]`` enters the
        whole walk, each segment starts from ``h0 + exp(cg) * s_in`` (``cg [NSEG + 1, B, D]``
        from the scan); HT_LAST: only the last segment stores its end state, into
        ``ht [B, D]``.  X_MAP, G_MAP: fused elementwise prologues applied to every x, g
        block as it is used (``tiles.mapped_tile``; g kept in fp32).

        The walk is latency bound (one dependent step per block), and Triton does not
        software-pipeline loads that feed no dot, so the loop does it by hand: the next
        block's x and g are loaded before this block is scanned."""
        i_d, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_s = tl.num_programs(2)
        slot = i_s * tl.num_programs(1) + i_b
        cols = i_d * BD + tl.arange(0, BD)
        rows = tl.arange(0, BT)
        cmask = cols < D
        base = i_b.to(tl.int64) * T * D  # passes 2**31 at long T
        if HAS_H0:
            b_h = tl.load(h0 + slot * D + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            b_h = tl.zeros([BD], dtype=tl.float32)
        if HAS_SIN:
            b_si = tl.load(s_in + i_b * D + cols, mask=cmask, other=0.0).to(tl.float32)
            b_h += tl.exp(tl.load(cg + slot * D + cols, mask=cmask, other=0.0)) * b_si
        b_gt = tl.zeros([BD], dtype=tl.float32)
        t_lo = i_s * SEG
        p_x = tl.make_block_ptr(x + base, (T, D), (D, 1), (t_lo, i_d * BD), (BT, BD), (1, 0))
        p_g = tl.make_block_ptr(g + base, (T, D), (D, 1), (t_lo, i_d * BD), (BT, BD), (1, 0))
        b_xn = tl.load(p_x, boundary_check=(0, 1))
        b_gn = tl.load(p_g, boundary_check=(0, 1))
        for t0 in range(t_lo, tl.minimum(T, t_lo + SEG), BT):
            if X_MAP is not None:
                b_xn = mapped_tile(b_xn, X_MAP, t0, T, i_d * BD, D, BT, BD)
            b_x = b_xn.to(tl.float32)
            b_g = b_gn.to(tl.float32)
            if G_MAP is not None:
                b_g = mapped_tile(b_g, G_MAP, t0, T, i_d * BD, D, BT, BD)
            # the next block in flight while this one is scanned (past T: zeros)
            p_x = tl.advance(p_x, (BT, 0))
            p_g = tl.advance(p_g, (BT, 0))
            b_xn = tl.load(p_x, boundary_check=(0, 1))
            b_gn = tl.load(p_g, boundary_check=(0, 1))
            b_A, b_X = tl.associative_scan((tl.exp(b_g), b_x), axis=0, combine_fn=_affine)
            b_o = b_A * b_h[None, :] + b_X
            if STORE_O:
                p_o = tl.make_block_ptr(o + base, (T, D), (D, 1), (t0, i_d * BD), (BT, BD), (1, 0))
                tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
            # padded rows carry g = 0, x = 0: the last row holds the last real token's state
            b_h = tl.sum(tl.where((rows == BT - 1)[:, None], b_o, 0.0), axis=0)
            if STORE_GT:
                b_gt += tl.sum(b_g, axis=0)
        if HT_LAST:
            if i_s == n_s - 1:
                tl.store(ht + i_b * D + cols, b_h, mask=cmask)
        else:
            tl.store(ht + slot * D + cols, b_h, mask=cmask)
        if STORE_GT:
            tl.store(gt + slot * D + cols, b_gt, mask=cmask)

    @triton.jit
    def _hgrn_scan_kernel(hs, gt, h0, ht, NSEG, D: tl.constexpr, BD: tl.constexpr,
                          HAS_H0: tl.constexpr, STORE_CG: tl.constexpr = False, cg=None,
                          REVERSE: tl.constexpr = False):
        """grid ``(cdiv(D, BD), B)``: segment end states (zero start) -> segment start states
        in place; ht [B, D] the final state; STORE_CG: ``cg [NSEG + 1, B, D]`` the log decay
        from the start to each segment's start (row NSEG: the total).  REVERSE: the segments
        are taken last to first (the backward's carries, which run right to left)."""
        i_d, i_b = tl.program_id(0), tl.program_id(1)
        NB = tl.num_programs(1)
        cols = i_d * BD + tl.arange(0, BD)
        cmask = cols < D
        if HAS_H0:
            b_h = tl.load(h0 + i_b * D + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            b_h = tl.zeros([BD], dtype=tl.float32)
        b_c = tl.zeros([BD], dtype=tl.float32)
        for j in range(0, NSEG):
            if REVERSE:
                i_s = NSEG - 1 - j
            else:
                i_s = j
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

    @triton.jit
    def _hgrn_bwd_kernel(g, do, h, h0, cin, dx, dg, cout, gout, T, SEG, D: tl.constexpr,
                         BT: tl.constexpr, BD: tl.constexpr, HAS_DO: tl.constexpr,
                         HAS_H0: tl.constexpr, HAS_CIN: tl.constexpr, GRADS: tl.constexpr):
        """grid ``(cdiv(D, BD), B, NSEG)``: program ``(i_d, i_b, i_s)`` walks the tokens
        ``[i_s * SEG, (i_s + 1) * SEG)`` (SEG a multiple of BT) from the last, a block of BT
        tokens per step (module docstring).  In a block, ``dh_r = do_r + a_{r+1} dh_{r+1}``
        (``a = exp(g)``) is a reverse scan of the maps ``y -> a_{r+1} y + do_r``; the last row's
        multiplier is 1, since the carry entering from the right, ``exp(g) dh`` of the token
        there, already holds its decay.  The block to the left is loaded before this one is
        scanned (Triton does not pipeline these loads).

        g, do, dx [B, T, D]; dg [B, T, D] (any float dtype); h [B, T, D] the forward's states
        ``h_t`` (any float dtype) and h0 [B, D] fp32 the state before token 0 (HAS_H0);
        cin [NSEG, B, D] fp32 (HAS_CIN) the gradient entering each segment from its right
        (the last one: dht), else 0.  GRADS: store dx and dg.  Always: ``cout [NSEG, B, D]``
        the gradient leaving the segment to its left (``exp(g) dh`` of its first token) and
        ``gout [NSEG, B, D]`` the segment's summed log decay (the reverse scan over segments
        needs both)."""
        i_d, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = i_s * tl.num_programs(1) + i_b
        cols = i_d * BD + tl.arange(0, BD)
        rows = tl.arange(0, BT)
        cmask = cols < D
        base = i_b.to(tl.int64) * T * D
        if HAS_CIN:
            b_carry = tl.load(cin + slot * D + cols, mask=cmask, other=0.0)
        else:
            b_carry = tl.zeros([BD], dtype=tl.float32)
        if GRADS and HAS_H0:
            b_h0 = tl.load(h0 + i_b * D + cols, mask=cmask, other=0.0)
        b_gsum = tl.zeros([BD], dtype=tl.float32)
        t_lo = i_s * SEG
        n_blk = tl.cdiv(tl.minimum(T, t_lo + SEG) - t_lo, BT)
        t_top = t_lo + (n_blk - 1) * BT  # the last block's first token
        # g of the block's tokens and of the tokens one to the right (the multipliers)
        p_g = tl.make_block_ptr(g + base, (T, D), (D, 1), (t_top, i_d * BD), (BT, BD), (1, 0))
        p_gr = tl.make_block_ptr(g + base, (T, D), (D, 1), (t_top + 1, i_d * BD), (BT, BD),
                                 (1, 0))
        p_do = tl.make_block_ptr(do + base, (T, D), (D, 1), (t_top, i_d * BD), (BT, BD), (1, 0))
        p_hp = tl.make_block_ptr(h + base, (T, D), (D, 1), (t_top - 1, i_d * BD), (BT, BD),
                                 (1, 0))
        b_gn = tl.load(p_g, boundary_check=(0, 1))
        b_grn = tl.load(p_gr, boundary_check=(0, 1))
        if HAS_DO:
            b_don = tl.load(p_do, boundary_check=(0, 1))
        if GRADS:
            b_hpn = tl.load(p_hp, boundary_check=(0, 1))  # row -1 (token 0's h_{-1}): 0
        for i in range(n_blk):
            t0 = t_top - i * BT
            b_g = b_gn.to(tl.float32)
            b_ar = tl.where((rows == BT - 1)[:, None], 1.0, tl.exp(b_grn.to(tl.float32)))
            if HAS_DO:
                b_do = b_don.to(tl.float32)
            else:
                b_do = tl.zeros([BT, BD], dtype=tl.float32)
            if GRADS:
                b_hp = b_hpn.to(tl.float32)
            # the block to the left in flight while this one is scanned (row < 0: zeros)
            p_g = tl.advance(p_g, (-BT, 0))
            p_gr = tl.advance(p_gr, (-BT, 0))
            b_gn = tl.load(p_g, boundary_check=(0, 1))
            b_grn = tl.load(p_gr, boundary_check=(0, 1))
            if HAS_DO:
                p_do = tl.advance(p_do, (-BT, 0))
                b_don = tl.load(p_do, boundary_check=(0, 1))
            if GRADS:
                p_hp = tl.advance(p_hp, (-BT, 0))
                b_hpn = tl.load(p_hp, boundary_check=(0, 1))
            b_P, b_Y = tl.associative_scan((b_ar, b_do), axis=0, combine_fn=_affine,
                                           reverse=True)
            b_dh = b_Y + b_P * b_carry[None, :]
            b_eg = tl.exp(b_g)
            if GRADS:
                if HAS_H0:
                    b_hp = tl.where((t0 + rows == 0)[:, None], b_h0[None, :], b_hp)
                p_dx = tl.make_block_ptr(dx + base, (T, D), (D, 1), (t0, i_d * BD), (BT, BD),
                                         (1, 0))
                p_dg = tl.make_block_ptr(dg + base, (T, D), (D, 1), (t0, i_d * BD), (BT, BD),
                                         (1, 0))
                tl.store(p_dx, b_dh.to(p_dx.dtype.element_ty), boundary_check=(0, 1))
                # a product of three factors: relative precision at any gate
                tl.store(p_dg, (b_dh * b_eg * b_hp).to(p_dg.dtype.element_ty),
                         boundary_check=(0, 1))
            b_carry = tl.sum(tl.where((rows == 0)[:, None], b_eg * b_dh, 0.0), axis=0)
            b_gsum += tl.sum(b_g, axis=0)
        tl.store(cout + slot * D + cols, b_carry, mask=cmask)
        tl.store(gout + slot * D + cols, b_gsum, mask=cmask)


if HAVE_TRITON:
    _hgrn_tuned = triton.autotune(
        configs=[triton.Config({"BT": bt, "BD": bd}, num_warps=nw)
                 for bt in (32, 64, 128) for bd in (16, 32, 64) for nw in (2, 4)
                 if bt * bd <= 4096],
        key=["D", "HAS_H0", "STORE_O", "STORE_GT"])(_hgrn_kernel)


def walk_launch(*, h0, o, ht, gt, B: int, T: int, D: int, seg: int, n: int, cfg: dict,
                s_in=None, cg=None, ht_last: bool = False, maps=None) -> Launch:
    """One ``_hgrn_kernel`` launch over ``n`` segments of ``seg`` tokens on buffers ``x, g``
    (every other tensor a buffer name or ``None``): from ``h0`` (``None``: zeros), outputs
    into ``o`` where named, end states into ``ht``, the segments' summed log decays into
    ``gt`` where named; ``s_in``: an incoming state folded in, decayed through ``cg``;
    ``ht_last``: only the last segment stores its end state.  ``maps``: fused prologues of
    x and g."""
    args = (("x", "buf", "x"), ("g", "buf", "g"), ("h0", "buf", h0 or ht),
            ("o", "buf", o or ht), ("ht", "buf", ht), ("gt", "buf", gt or ht),
            ("T", "i32", T), ("SEG", "i32", seg))
    const = (("D", D), ("BT", cfg["BT"]), ("BD", cfg["BD"]), ("HAS_H0", h0 is not None),
             ("STORE_O", o is not None), ("STORE_GT", gt is not None),
             ("HAS_SIN", s_in is not None))
    if s_in is not None:
        args = args + (("s_in", "buf", s_in), ("cg", "buf", cg or s_in))
    else:
        const = const + (("s_in", None), ("cg", None))
    const = const + (("HT_LAST", ht_last),) + map_consts(maps, "xg")
    return Launch("hgrn", (cdiv(D, cfg["BD"]), B, n), args, const, cfg["num_warps"],
                  cfg["num_stages"])


def scan_launch(*, hs: str, gt: str, h0: Optional[str], ht: str, n_seg: int, B: int, D: int,
                BD: int, num_warps: int, cg: Optional[str] = None,
                reverse: bool = False) -> Launch:
    """The scan over segments (``_hgrn_scan_kernel``): ``hs [n_seg, B, D]`` (each segment's
    end state from a zero start, made its start state in place) and ``gt [n_seg, B, D]``
    from ``h0`` (``None``: zeros) to ``ht [B, D]``; ``cg [n_seg + 1, B, D]``: also the log
    decay to each segment's start; ``reverse``: right to left (the backward)."""
    args = (("hs", "buf", hs), ("gt", "buf", gt), ("h0", "buf", h0 or ht), ("ht", "buf", ht),
            ("NSEG", "i32", n_seg))
    const = (("D", D), ("BD", BD), ("HAS_H0", h0 is not None), ("STORE_CG", cg is not None))
    if cg is not None:
        args = args + (("cg", "buf", cg),)
    else:
        const = const + (("cg", None),)
    return Launch("hgrn_scan", (cdiv(D, BD), B, 1), args, const + (("REVERSE", reverse),),
                  num_warps, 3)


def backward_walk_launch(*, grads: bool, cin: Optional[str], has_h0: bool, has_do: bool,
                         B: int, T: int, D: int, seg: int, n: int, BD: int,
                         cfg: dict) -> Launch:
    """One ``_hgrn_bwd_kernel`` launch over ``n`` segments of ``seg`` tokens on buffers
    ``g, do, h`` (the forward's states), ``h0`` (``has_h0``), ``cin`` (the gradient entering
    each segment from its right, ``None``: zeros), ``dx, dg`` (written with ``grads``),
    ``cout, gout`` (each segment's outgoing gradient and summed log decay)."""
    return Launch("hgrn_bwd", (cdiv(D, BD), B, n),
                  (("g", "buf", "g"), ("do", "buf", "do" if has_do else "h"),
                   ("h", "buf", "h"), ("h0", "buf", "h0" if has_h0 else "cout"),
                   ("cin", "buf", cin or "cout"), ("dx", "buf", "dx"), ("dg", "buf", "dg"),
                   ("cout", "buf", "cout"), ("gout", "buf", "gout"), ("T", "i32", T),
                   ("SEG", "i32", seg)),
                  (("D", D), ("BT", cfg["BT"]), ("BD", BD), ("HAS_DO", has_do),
                   ("HAS_H0", has_h0 and grads), ("HAS_CIN", cin is not None),
                   ("GRADS", grads)), cfg["num_warps"], cfg["num_stages"])


def _launch(ln: Launch, tensors: dict) -> None:
    kernel = {"hgrn": _hgrn_kernel, "hgrn_scan": _hgrn_scan_kernel,
              "hgrn_bwd": _hgrn_bwd_kernel}[ln.kernel]
    run_launch(ln, tensors, kernel)


def hgrn_forward(x, g, h0, *, out_dtype, store_o: bool = True, n_seg: int = 1, maps=None):
    """``(o [B, T, D] or None, final [B, D] fp32)``; ``h0 [B, D]`` or ``None``.

    ``n_seg > 1``: DECOUPLED over segments (summaries in parallel, a scan over segments,
    outputs in parallel), as the matrix patterns' ``walk``: the launches of
    :func:`forward_program`.  ``maps``: fused prologues of ``x`` and ``g`` (input name ->
    jitted map).
    """
    B, T, D = x.shape
    o = torch.empty(B, T, D, dtype=out_dtype, device=x.device) if store_o else None
    ht = torch.empty(B, D, dtype=torch.float32, device=x.device)
    if h0 is not None:
        h0 = h0.reshape(B, D).to(torch.float32).contiguous()
    tensors = {"x": x, "g": g, "ht": ht}
    tensors.update((n, t) for n, t in (("o", o), ("h0", h0)) if t is not None)
    if use_autotune() and n_seg == 1:
        ln = walk_launch(h0="h0" if h0 is not None else None, o="o" if store_o else None,
                         ht="ht", gt=None, B=B, T=T, D=D, seg=T, n=1, cfg=FUSED_CONFIG,
                         maps=maps)
        call = {name: tensors[value] if kind == "buf" else value
                for name, kind, value in ln.args}
        consts = {n: v for n, v in ln.constexprs if n not in ("BT", "BD")}
        _hgrn_tuned[lambda meta: (cdiv(D, meta["BD"]), B, 1)](**call, **consts)
        return o, ht
    if not maps:  # (the works pass {} for no prologues)
        prog = _eager_program(B, T, D, x.dtype, h0 is not None, store_o, n_seg,
                              tuple(FUSED_CONFIG.items()))
    else:
        prog = forward_program(B=B, T=T, D=D, dtype=x.dtype, has_h0=h0 is not None,
                               store_o=store_o, n_seg=n_seg, maps=maps)
    for name, buf in prog.buffers.items():
        if buf.role == "workspace":
            tensors[name] = torch.empty(buf.shape, dtype=buf.dtype, device=x.device)
    for ln in prog.launches:
        _launch(ln, tensors)
    return o, ht


@functools.lru_cache(maxsize=64)
def _eager_program(B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool, store_o: bool,
                   n_seg: int, config: tuple) -> Program:
    """:func:`forward_program` of :func:`hgrn_forward`, kept per shape and tile config
    (``FUSED_CONFIG``'s items, which tuning or a test may change): building it (the buffers
    and launch records) is 10-17 us of Python, which a short eager call (the
    sequence-parallel runner's, ``shard_call``'s) paid every time.  Read only."""
    return forward_program(B=B, T=T, D=D, dtype=dtype, has_h0=has_h0, store_o=store_o,
                           n_seg=n_seg, tiles=dict(config))


def forward_program(*, B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool,
                    store_o: bool = True, tiles: Optional[dict] = None,
                    gate_dtype: Optional[torch.dtype] = None, execution: Optional[str] = None,
                    n_seg: Optional[int] = None,
                    maps: Optional[Dict[str, Any]] = None, summary: str = "none") -> Program:
    """The launches of one hgrn segment as a :class:`~.ir.Program`: inputs ``x [B, T, D]``,
    ``g [B, T, D]`` (``gate_dtype``, default ``dtype``), ``h0 [B, D]`` fp32; outputs ``o
    [B, T, D]`` and ``ht [B, D]`` fp32.  One walk, or (decoupled) the segments' walks, the
    scan over segments and the output walks, with workspaces ``hs, gt [n_seg, B, D]``.
    ``n_seg`` fixes the segment count, else the scheduler picks it (``execution``);
    ``tiles`` overrides entries of :data:`FUSED_CONFIG`; ``maps``: fused prologues of x, g.

    A sequence-parallel rank's program (``summary``, as the matrix patterns': the state pass
    runs before its last launch, which reads ``h0``, the incoming state):

    * ``"folded"`` (a rank before the last): the segments' walks from zero, the scan of their
      end states from zero into the shard's state ``delta [B, 1, D, 1]`` and the log decay
      to each segment's start ``cg [n_seg + 1, B, 1, D]`` (row ``n_seg``: the shard's
      transition, in the runtime layout of :mod:`forge_dist.sp`), then the output walks,
      which carry ``h0`` into each segment's start through ``cg``; decoupled even for one
      segment, whose summary the pass reads;
    * ``"incoming"`` (the last rank): the same where the scheduler splits the shard, else
      the one walk from ``h0``.
    """
    if summary not in ("none", "folded", "incoming"):
        raise ValueError(f"summary: expected 'none', 'folded' or 'incoming' for hgrn, got "
                         f"{summary!r}")
    cfg = dict(FUSED_CONFIG, **(tiles or {}))
    bufs = {"x": Buffer((B, T, D), dtype, "input"),
            "g": Buffer((B, T, D), gate_dtype or dtype, "input"),
            "ht": Buffer((B, D), torch.float32, "output")}
    if store_o:
        bufs["o"] = Buffer((B, T, D), dtype, "output")
    if has_h0:
        bufs["h0"] = Buffer((B, D), torch.float32, "input")
    sched = None
    if n_seg is None:
        sched = scheduler.schedule_vector_state(
            B, T, D, cfg["BT"], cfg["BD"], elem_size=torch.empty((), dtype=dtype).element_size(),
            request=execution)
        n_seg = sched.n_seg
    seg, n_seg = _segments(T, cfg["BT"], n_seg)
    notes = [] if sched is None else [
        f"execution {sched.strategy} ({n_seg} segments): {sched.reason}"]
    common = dict(B=B, T=T, D=D, seg=seg, n=n_seg, cfg=cfg, maps=maps)
    h0 = "h0" if has_h0 else None
    o = "o" if store_o else None
    if summary == "folded" or (summary == "incoming" and n_seg > 1):
        return _folded_program(bufs, common, h0, o, notes)
    if n_seg == 1:
        launches = [walk_launch(h0=h0, o=o, ht="ht", gt=None, **common)]
        return Program(launches, bufs, scheduler.FUSED, notes)
    bufs["hs"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["gt"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    launches = [walk_launch(h0=None, o=None, ht="hs", gt="gt", **common),
                scan_launch(hs="hs", gt="gt", h0=h0, ht="ht", n_seg=n_seg, B=B, D=D,
                            BD=cfg["BD"], num_warps=cfg["num_warps"])]
    if store_o:
        launches.append(walk_launch(h0="hs", o="o", ht="hs", gt=None, **common))
    return Program(launches, bufs, scheduler.DECOUPLED, notes)


def _folded_program(bufs: dict, common: dict, h0: Optional[str], o: Optional[str],
                    notes: list) -> Program:
    """:func:`forward_program`'s ``"folded"`` form (its docstring): the launches of
    :func:`hgrn_summarize` and then of :func:`hgrn_outputs`."""
    B, D, n_seg, cfg = common["B"], common["D"], common["n"], common["cfg"]
    bufs["hs"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["gt"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["delta"] = Buffer((B, 1, D, 1), torch.float32, "workspace")
    bufs["cg"] = Buffer((n_seg + 1, B, 1, D), torch.float32, "workspace")
    launches = [walk_launch(h0=None, o=None, ht="hs", gt="gt", **common),
                scan_launch(hs="hs", gt="gt", h0=None, ht="delta", cg="cg", n_seg=n_seg, B=B,
                            D=D, BD=cfg["BD"], num_warps=cfg["num_warps"]),
                # hs now holds each segment's start from zero
                walk_launch(h0="hs", o=o, ht="ht", gt=None, s_in=h0, cg=h0 and "cg",
                            ht_last=True, **common)]
    return Program(launches, bufs, scheduler.DECOUPLED,
                   notes + [f"sequence-parallel summary over {n_seg} segment(s)"])


def _segments(T: int, BT: int, n_seg: int):
    seg = segment_length(T, BT, n_seg)
    return seg, max(1, -(-T // seg))


def hgrn_summarize(x, g, *, n_seg: int = 1, maps=None) -> SegmentStates:
    """The shard summary with its segment states kept (see ``walker.summarize``); states
    ``[B, D]``: ``delta`` from a zero start, ``decay_to [n_seg + 1, B, D]``."""
    B, T, D = x.shape
    cfg = FUSED_CONFIG
    seg, n_seg = _segments(T, cfg["BT"], n_seg)
    hs = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    gt = torch.empty(n_seg, B, D, dtype=torch.float32, device=x.device)
    tensors = {"x": x, "g": g, "hs": hs, "gt": gt}
    _launch(walk_launch(h0=None, o=None, ht="hs", gt="gt", B=B, T=T, D=D, seg=seg, n=n_seg,
                        cfg=cfg, maps=maps), tensors)
    if n_seg == 1:
        return SegmentStates(1, seg, hs[0], None, torch.cat([torch.zeros_like(gt), gt]))
    tensors["delta"] = delta = torch.empty(B, D, dtype=torch.float32, device=x.device)
    tensors["cg"] = decay_to = torch.empty(n_seg + 1, B, D, dtype=torch.float32,
                                           device=x.device)
    _launch(scan_launch(hs="hs", gt="gt", h0=None, ht="delta", cg="cg", n_seg=n_seg, B=B,
                        D=D, BD=cfg["BD"], num_warps=cfg["num_warps"]), tensors)
    return SegmentStates(n_seg, seg, delta, hs, decay_to)


def hgrn_outputs(summ: SegmentStates, x, g, S_in, *, out_dtype, maps=None):
    """``(o [B, T, D], final [B, D])`` from a kept summary and the incoming state ``[B, D]``."""
    B, T, D = x.shape
    o = torch.empty(B, T, D, dtype=out_dtype, device=x.device)
    ht = torch.empty(B, D, dtype=torch.float32, device=x.device)
    if S_in is not None:
        S_in = S_in.reshape(B, D).to(torch.float32).contiguous()
    tensors = {"x": x, "g": g, "o": o, "ht": ht}
    s_in = "s_in" if S_in is not None else None
    if summ.n_seg == 1:
        if S_in is not None:
            tensors["h0"] = S_in
        ln = walk_launch(h0=s_in and "h0", o="o", ht="ht", gt=None, B=B, T=T, D=D,
                         seg=summ.seg, n=1, cfg=FUSED_CONFIG, maps=maps)
    else:
        tensors["starts"] = summ.starts
        if S_in is not None:
            tensors.update(s_in=S_in, cg=summ.decay_to)
        ln = walk_launch(h0="starts", o="o", ht="ht", gt=None, B=B, T=T, D=D, seg=summ.seg,
                         n=summ.n_seg, cfg=FUSED_CONFIG, s_in=s_in, cg=s_in and "cg",
                         ht_last=True, maps=maps)
    _launch(ln, tensors)
    return o, ht


# Two tokens per step, 256 channels, one warp.  Measured on H200 at [1, T, 4096] bf16,
# recompute + reverse walk (results/kernel_profile_hgrnbwd_2026-11-24): 1.94 ms at 64K with
# 128 segments (one token per step 1.92, 8 tokens 2.41 at best: the four loads of a wide block
# spill), 0.30 ms at 4K.  The chunked form (an associative scan per [64, 32] tile, chunk
# states recomputed) took 8.4 ms at 64K (results/kernel_profile_hgrnsweep_*).
BWD_CONFIG = {"BT": 2, "BD": 256, "num_warps": 1, "num_stages": 2}


def hgrn_backward(x, g, S_in, do, dht, *, BD: int | None = None, n_seg: int = 1,
                  dg_dtype: torch.dtype = torch.float32, h=None):
    """Gradients of ``(o, final)`` of ``h_t = exp(g_t) h_{t-1} + x_t`` (module docstring).

    The reverse walk reads the forward's states ``h_{t-1}``: ``h``, the forward's outputs
    (``o_t = h_t``), when the caller kept them, else they are recomputed first
    (:func:`hgrn_forward`, stored in x's dtype, as the forward's outputs are).

    Args:
        x: ``[B, T, D]``; g: ``[B, T, D]`` log decays; S_in: incoming state ``[B, D]`` or
            ``None``; do: gradient of ``o`` ``[B, T, D]`` or ``None``; dht: gradient of the
            final state ``[B, D]`` or ``None``.  BD overrides the channel tile.
        n_seg: segments walked in parallel (DECOUPLED, as the forward): each segment's
            outgoing gradient from a zero start, a reverse scan over the segments, then every
            segment's gradients from its incoming one.  1: one walk over the whole sequence.
        dg_dtype: dtype ``dg`` is stored in (computed in fp32; the op passes g's dtype, which
            saves a full fp32 write and a conversion pass).
        h: the forward's outputs ``[B, T, D]`` (any float dtype) from the same ``S_in``, or
            ``None`` (recompute).
    Returns:
        ``(dx [B, T, D] in x's dtype, dg [B, T, D] in dg_dtype, dS_in [B, D] fp32 or None)``.
    """
    B, T, D = x.shape
    if dht is not None and tuple(dht.shape) != (B, D):
        raise ValueError(f"dht: expected shape {(B, D)}, got {tuple(dht.shape)}")
    bw = HgrnBackward(x, g, S_in, do, BD=BD, n_seg=n_seg, dg_dtype=dg_dtype, h=h)
    if bw.n_seg > 1:
        bw.summaries()
    dx, dg, dS_in = bw.finish(dht)
    return dx, dg, (dS_in if S_in is not None else None)


class HgrnBackward:
    """:func:`hgrn_backward` in the steps a sequence-parallel rank runs around the reverse
    chain of state gradients (``forge_dist/ops/shard_call.py``): :meth:`summaries` (each
    segment's outgoing gradient from a zero start, which needs no gradient of the final
    state), :meth:`state_grad` (the incoming state's gradient for a given final-state
    gradient: the reverse scan alone, on copies) and :meth:`finish` (the scan and the walk
    that writes dx and dg).  Arguments as :func:`hgrn_backward`'s."""

    def __init__(self, x, g, S_in, do, *, BD: int | None = None, n_seg: int = 1,
                 dg_dtype: torch.dtype = torch.float32, h=None):
        B, T, D = x.shape
        if g.shape != x.shape:
            raise ValueError(f"g: expected shape {tuple(x.shape)} (like x), got "
                             f"{tuple(g.shape)}")
        for name, t, shape in (("do", do, x.shape), ("S_in", S_in, (B, D)), ("h", h, x.shape)):
            if t is not None and tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got "
                                 f"{tuple(t.shape)}")
        self.BD = BD = BD or BWD_CONFIG["BD"]
        x, g = x.contiguous(), g.contiguous()
        do = None if do is None else do.contiguous()
        f32 = torch.float32
        dev = x.device
        h0 = None if S_in is None else S_in.to(f32).contiguous()
        if h is None:
            h, _ = hgrn_forward(x, g, h0, out_dtype=x.dtype, n_seg=n_seg)
        seg, self.n_seg = _segments(T, BWD_CONFIG["BT"], n_seg)
        self.x, self.shape, self.dg_dtype, self._summed = x, (B, T, D), dg_dtype, False
        # before the last walk, dx and dg are not written: x stands in for them
        self.tensors = {"g": g, "h": h.contiguous(), "dx": x, "dg": x,
                        "cout": torch.empty(self.n_seg, B, D, dtype=f32, device=dev),
                        "gout": torch.empty(self.n_seg, B, D, dtype=f32, device=dev)}
        self.tensors.update((n, t) for n, t in (("do", do), ("h0", h0)) if t is not None)
        self.common = dict(has_h0=h0 is not None, has_do=do is not None, B=B, T=T, D=D,
                           seg=seg, n=self.n_seg, BD=BD, cfg=BWD_CONFIG)

    def summaries(self) -> None:
        """Each segment's outgoing gradient from a zero start (``cout``) and summed log
        decay (``gout``): reads g and do only."""
        _launch(backward_walk_launch(grads=False, cin=None, **self.common), self.tensors)
        self._summed = True

    def _bind_dht(self, t: dict, dht) -> Optional[str]:
        """Put the final-state gradient into ``t`` as the kernels read it (fp32 ``[1, B,
        D]``); its buffer name, or ``None`` (zero)."""
        if dht is None:
            return None
        B, _, D = self.shape
        t["dht"] = dht.to(torch.float32).reshape(1, B, D).contiguous()
        return "dht"

    def _scan(self, t: dict, dht) -> None:
        """In place: ``cout[s]`` becomes the gradient entering segment ``s`` from its right,
        and the gradient leaving the first segment lands in ``gout[0]``."""
        B, _, D = self.shape
        _launch(scan_launch(hs="cout", gt="gout", h0=self._bind_dht(t, dht),
                            ht="gout", n_seg=self.n_seg, B=B, D=D, BD=self.BD,
                            num_warps=BWD_CONFIG["num_warps"], reverse=True), t)

    def state_grad(self, dht) -> torch.Tensor:
        """``dS_in [B, D]`` fp32 for the final-state gradient ``dht`` (``None``: zero),
        after :meth:`summaries`; the summaries stay as they were for :meth:`finish`."""
        if not self._summed:
            raise RuntimeError("HgrnBackward.state_grad: run summaries() first")
        t = dict(self.tensors, cout=self.tensors["cout"].clone(),
                 gout=self.tensors["gout"].clone())
        self._scan(t, dht)
        return t["gout"][0]

    def finish(self, dht):
        """``(dx, dg, dS_in)`` for the final-state gradient ``dht`` (``None``: zero): one
        fused walk, or after :meth:`summaries` the scan and the segments' walks."""
        t = self.tensors
        if self._summed:
            self._scan(t, dht)
            # each program reads its segment's incoming gradient before it writes the
            # outgoing one to the same slot, so the walk runs in place
            cin = "cout"
        elif self.n_seg == 1:
            cin = self._bind_dht(t, dht)
        else:
            raise RuntimeError("HgrnBackward.finish: segments need summaries() first")
        t["dx"] = dx = torch.empty_like(self.x)
        t["dg"] = dg = torch.empty(self.shape, dtype=self.dg_dtype, device=dx.device)
        _launch(backward_walk_launch(grads=True, cin=cin, **self.common), t)
        return dx, dg, t["cout"][0].clone()  # what leaves the first segment


def backward_program(*, B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool,
                     has_dht: bool, gate_dtype: Optional[torch.dtype] = None,
                     execution: Optional[str] = None) -> Program:
    """The launches of :func:`hgrn_backward` from the forward's kept outputs (``h=o``) as a
    :class:`~.ir.Program`.

    Inputs ``g [B, T, D]`` (``gate_dtype``, default ``dtype``), ``do`` and ``h`` (the
    forward's outputs) ``[B, T, D]`` (``dtype``), ``h0 [B, D]`` fp32 (``has_h0``), ``dht
    [B, D]`` fp32 (``has_dht``); outputs ``dx`` (``dtype``) and ``dg`` (``gate_dtype``)
    ``[B, T, D]``; workspace ``cout [n_seg, B, D]`` fp32, whose row 0 is then ``dS_in``.
    DECOUPLED as the kernels: each segment's outgoing gradient from a zero start, the
    segment scan right to left (in place), then every segment's walk from its incoming
    gradient, again in place (a program reads its slot before it writes it).
    """
    cfg = BWD_CONFIG
    gdt = gate_dtype or dtype
    bufs = {"g": Buffer((B, T, D), gdt, "input"), "do": Buffer((B, T, D), dtype, "input"),
            "h": Buffer((B, T, D), dtype, "input"),
            "dx": Buffer((B, T, D), dtype, "output"), "dg": Buffer((B, T, D), gdt, "output")}
    if has_h0:
        bufs["h0"] = Buffer((B, D), torch.float32, "input")
    if has_dht:
        bufs["dht"] = Buffer((B, D), torch.float32, "input")
    sched = scheduler.schedule_vector_state(
        B, T, D, cfg["BT"], cfg["BD"], elem_size=torch.empty((), dtype=dtype).element_size(),
        request=execution, resident_per_sm=scheduler.VECTOR_STATE_BWD_RESIDENT_PER_SM)
    seg, n_seg = _segments(T, cfg["BT"], sched.n_seg)
    bufs["cout"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["gout"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    common = dict(has_h0=has_h0, has_do=True, B=B, T=T, D=D, seg=seg, n=n_seg, BD=cfg["BD"],
                  cfg=cfg)
    notes = [f"backward execution {sched.strategy} ({n_seg} segments): {sched.reason}"]
    if n_seg == 1:
        return Program([backward_walk_launch(grads=True, cin="dht" if has_dht else None,
                                             **common)], bufs, scheduler.FUSED, notes)
    scan = scan_launch(hs="cout", gt="gout", h0="dht" if has_dht else None, ht="gout",
                       n_seg=n_seg, B=B, D=D, BD=cfg["BD"], num_warps=cfg["num_warps"],
                       reverse=True)
    return Program([backward_walk_launch(grads=False, cin=None, **common), scan,
                    backward_walk_launch(grads=True, cin="cout", **common)], bufs,
                   scheduler.DECOUPLED, notes)


def state_grad_program(*, B: int, D: int, n_seg: int, has_dht: bool) -> Program:
    """The reverse scan of :func:`backward_program` alone: the gradient of a shard's
    incoming state through its own outputs (and ``dht``), a sequence-parallel rank's share
    of its state gradient (``forge_dist/runtime/sp_train.py``).  Inputs ``cs, gs [n_seg,
    B, D]`` fp32: the backward's ``cout`` after its first walk, a copy (the scan rewrites
    it in place), and its ``gout`` (read only), ``dht [B, D]`` fp32 (``has_dht``); output
    ``lam [B, D]`` fp32."""
    f32 = torch.float32
    bufs = {"cs": Buffer((n_seg, B, D), f32, "input"), "gs": Buffer((n_seg, B, D), f32, "input"),
            "lam": Buffer((B, D), f32, "output")}
    if has_dht:
        bufs["dht"] = Buffer((B, D), f32, "input")
    scan = scan_launch(hs="cs", gt="gs", h0="dht" if has_dht else None, ht="lam", n_seg=n_seg,
                       B=B, D=D, BD=BWD_CONFIG["BD"], num_warps=BWD_CONFIG["num_warps"],
                       reverse=True)
    return Program([scan], bufs, scheduler.DECOUPLED, [f"state gradient over {n_seg} segments"])


def backward_kernel_specs(D: int = 4096, dtype=torch.bfloat16) -> list:
    """The :class:`~forge_dist.kernels.ir.KernelSpec` of the backward's own kernel
    (the reverse walk, with and without the gradients) as the planned backward launches it
    (:func:`backward_program`; the segment scan is the forward's kernel), for AOT
    compilation and the resource report."""
    specs = {}
    for execution in ("fused", "decoupled"):
        prog = backward_program(B=1, T=256, D=D, dtype=dtype, has_h0=True, has_dht=True,
                                     execution=execution)
        specs.update((s.key, s) for s in prog.specs() if s.kernel == "hgrn_bwd")
    return list(specs.values())


class VectorStateWork(TritonWork):
    """hgrn segment: ``x, g [B, T, D]``; states in the runtime layout ``[B, 1, D, 1]``."""

    names = ("x", "g")
    vector_state = True
    keeps_segments = True
    backward_reads_output = True  # o is the state sequence h: the backward needs no recompute

    def __init__(self, variant, inputs, scale, need_transition, out_dtype=None, execution=None,
                 maps=None):
        super().__init__(variant, inputs, 1.0, need_transition, out_dtype, execution, maps)

    def _finish_fwd(self, S_in, tensors):
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        if self.segments is not None:  # the summary ran: only the output walks remain
            o, ht = hgrn_outputs(self.segments, x, g, S_in, out_dtype=self.out_dtype,
                                 maps=self.maps)
            return o, ht.reshape(B, 1, D, 1)
        o, ht = hgrn_forward(x, g, S_in, out_dtype=self.out_dtype, n_seg=self._schedule_hgrn(x),
                             maps=self.maps)
        return o, ht.reshape(B, 1, D, 1)

    def _summary_fwd(self, tensors, need_M):
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        self.segments = hgrn_summarize(x, g, n_seg=self._schedule_hgrn(x, with_summary=True),
                                       maps=self.maps)
        M = self.segments.total_log_decay().exp()[:, None] if need_M else None  # [B, 1, D]
        return self.segments.delta.reshape(B, 1, D, 1), M

    # Triton backward ------------------------------------------------------------------------
    def _finish_bwd(self, S_in, tensors, do, dht, o=None):
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        dx, dg, dS = hgrn_backward(x, g, None if S_in is None else S_in.reshape(B, D), do,
                                   None if dht is None else dht.reshape(B, D),
                                   n_seg=self._schedule_hgrn(x, backward=True),
                                   dg_dtype=tensors[1].dtype, h=o)
        dS = None if dS is None else dS.reshape(S_in.shape).to(S_in.dtype)
        return [dS, dx, dg]

    def backward_steps(self, S_in, tensors, do, o) -> "HgrnBackward":
        """:meth:`_finish_bwd` as the steps a sequence-parallel rank runs around the reverse
        chain (:class:`HgrnBackward`, always over segments: their summaries need no
        gradient of the final state); ``S_in`` and the states in the runtime layout."""
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        return HgrnBackward(x, g, None if S_in is None else S_in.reshape(B, D), do,
                            n_seg=self._schedule_hgrn(x, backward=True),
                            dg_dtype=tensors[1].dtype, h=o)

    def _summary_bwd(self, tensors, ddelta, dM):
        """``delta`` is the final state from a zero start and ``M = exp(sum g)``: the same
        backward with no output gradient, plus ``dM * M`` on every gate."""
        x, g = (ensure(t) for t in tensors)
        B, T, D = x.shape
        dx, dg, _ = hgrn_backward(x, g, None, None,
                                  None if ddelta is None else ddelta.reshape(B, D),
                                  n_seg=self._schedule_hgrn(x, backward=True))
        if dM is not None:
            total = g.to(torch.float32).sum(dim=1)  # [B, D]
            dg += (dM.reshape(B, D).to(torch.float32) * total.exp())[:, None]
        return [dx, dg.to(tensors[1].dtype)]

    def _schedule_hgrn(self, x, with_summary: bool = False, backward: bool = False) -> int:
        B, T, D = x.shape
        cfg = BWD_CONFIG if backward else FUSED_CONFIG
        resident = (scheduler.VECTOR_STATE_BWD_RESIDENT_PER_SM if backward else
                    scheduler.VECTOR_STATE_RESIDENT_PER_SM)
        s = scheduler.schedule_vector_state(B, T, D, cfg["BT"], cfg["BD"],
                                            elem_size=x.element_size(),
                                            request=self.execution_request,
                                            with_summary=with_summary,
                                            resident_per_sm=resident)
        self.execution, self.execution_reason, self.n_seg = s.strategy, s.reason, s.n_seg
        return s.n_seg

    def _summary_torch(self, tensors, need_M):
        x, g = tensors
        return vector_state.summarize(x, g, need_transition=need_M)

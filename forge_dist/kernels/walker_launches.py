"""The walker's launches, each described once (:class:`~.ir.Launch` records).

The eager functions of :mod:`.walker` (``walk``, ``summarize``, ``outputs_from_summary``,
``chunk_gate_cumsum``) bind these records to tensors and launch them; the pattern modules'
``forward_program`` (and ``delta_backward.backward_program``) put the same records into
the programs that plans run and the AOT step compiles.  Buffers are named: a launch's
pointer argument is ``("buf", name)``; an absent optional tensor is replaced by a buffer
the kernel's constexpr flags keep it from reading.

Kernels: ``walk`` (``walker._walk_kernel``), ``segment_scan``
(``walker._segment_scan_kernel``) and ``gate_cumsum`` (``walker._gate_cumsum_kernel``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .ir import Buffer, Launch, cdiv, pow2

GATE_CUMSUM_WARPS = 4  # the gate-sum launch's warps


def segment_length(T: int, BT: int, n_seg: int) -> int:
    """Tokens per segment when ``T`` is cut into (at most) ``n_seg`` chunk-aligned segments."""
    n_chunks = max(1, -(-T // BT))
    return -(-n_chunks // max(1, n_seg)) * BT


def map_flags(maps: Optional[dict], names: str) -> dict:
    """The walker's constexpr prologue arguments (``Q_MAP`` ...) for the inputs in ``names``
    (``"qkv"``) that have a fused map in ``maps`` (input name -> jitted map); none are passed
    otherwise, so unmapped launches keep their compiled kernels."""
    if not maps:
        return {}
    return {f"{n.upper()}_MAP": maps[n] for n in names if maps.get(n) is not None}


def map_consts(maps: Optional[Dict[str, Any]], names: str) -> Tuple[Tuple[str, Any], ...]:
    """:func:`map_flags` as a launch's constexpr items."""
    return tuple(map_flags(maps, names).items())


# a pattern config's own tiles for summary walks (see walk_launch), by the tile they replace
SUMMARY_KEYS = {"BV": "summary_BV", "num_warps": "summary_warps", "num_stages": "summary_stages"}


def walk_launch(*, q, k, v, g, w, h0, o, ht, gt, B: int, T: int, H: int, K: int, V: int,
                gate: int, scale: float, cfg: dict, prec: str, seg: int, n: int,
                store_ht: bool = True, a=None, s_in=None, cg=None,
                ht_last: Optional[bool] = None, scan_in: bool = False, maps=None,
                raw_gates: bool = False, hc=None, vn=None, h0_eye: bool = False,
                t0: int = 0) -> Launch:
    """One walker launch over ``n`` segments of ``seg`` tokens from token ``t0`` (a
    multiple of the chunk); every tensor argument is a buffer name or ``None`` (absent).

    ``q`` (and ``o``) given: outputs are written; ``gate`` 0 none, 1 scalar (``g``: chunk
    sums ``[B, H, T]``, or with ``raw_gates`` the per-token gates ``[B, T, H]``, summed in
    the walk), 2 per channel; ``w``: the delta rule's WY correction; ``a``: a precomputed
    in-chunk attention (read only where ``q`` is given); ``gt``: the segments' summed log
    decays, written (or read with ``scan_in``); ``s_in``: an incoming state folded in
    (decayed through ``cg``, or with ``scan_in`` through the summaries' own ``gt``);
    ``scan_in``: the output walks fold the segment scan in; ``ht_last``: only the last
    segment stores the end state (default: ``scan_in``); ``hc, vn``: every chunk's start
    state and the values the state update used, kept for a backward pass; ``h0_eye``
    (``h0`` ``None``, ``V == K``): start from the identity (a dense transition's walk).
    """
    if h0_eye and (h0 is not None or V != K):
        raise ValueError(f"walk_launch: h0_eye starts a K x K walk from the identity, got "
                         f"h0={h0!r}, K={K}, V={V}")
    BK = pow2(K)
    # a summary (no outputs, no kept chunk states) streams k and v alone: its own V tile,
    # warps and pipeline depth where the pattern's config gives them
    summary = q is None and hc is None
    BV, warps, stages = (cfg.get(SUMMARY_KEYS[key], cfg[key]) if summary else cfg[key]
                         for key in ("BV", "num_warps", "num_stages"))
    BV = min(BV, pow2(V))
    has_a = a is not None and q is not None
    args = (("q", "buf", q or k), ("k", "buf", k), ("v", "buf", v or k), ("g", "buf", g or k),
            ("w", "buf", w or k), ("h0", "buf", h0 or ht), ("o", "buf", o or ht),
            ("ht", "buf", ht), ("gt", "buf", gt or ht), ("T", "i32", T), ("SEG", "i32", seg),
            ("T0", "i32", t0), ("scale", "fp32", float(scale)))
    const = (("H", H), ("K", K), ("V", V), ("BT", cfg["BT"]), ("BK", BK), ("BV", BV),
             ("GATE", gate), ("HAS_V", v is not None), ("HAS_W", w is not None),
             ("HAS_H0", h0 is not None), ("STORE_O", q is not None), ("STORE_HT", store_ht),
             ("PREC", prec), ("HAS_A", has_a))
    # an optional pointer is a buffer when given, else a None constexpr (as Triton's JIT
    # treats None)
    if has_a:
        args = args + (("a", "buf", a),)
    else:
        const = const + (("a", None),)
    const = const + (("STORE_GT", gt is not None and not scan_in),
                     ("HAS_SIN", s_in is not None))
    if s_in is not None:
        args = args + (("s_in", "buf", s_in),)
    else:
        const = const + (("s_in", None),)
    if s_in is not None and not scan_in:  # the incoming state's decay per segment
        args = args + (("cg", "buf", cg or s_in),)
    else:
        const = const + (("cg", None),)
    const = const + (("HT_LAST", scan_in if ht_last is None else ht_last),)
    if hc is not None:
        args = args + (("hc", "buf", hc), ("vn", "buf", vn))
        const = const + (("STORE_CHUNKS", True),)
    else:
        const = const + (("STORE_CHUNKS", False), ("hc", None), ("vn", None))
    const = const + (("SCAN_IN", scan_in),)
    const = const + map_consts(maps, ("q" if q else "") + "k" + ("v" if v else ""))
    if raw_gates:  # set only when on (the same compiled kernel as before the flag existed)
        const = const + (("G_RAW", True),)
    if h0_eye:  # likewise
        const = const + (("H0_EYE", True),)
    return Launch("walk", (cdiv(V, BV), B * H, n), args, const, warps, stages)


def segment_scan_launch(*, hs: str, gt: Optional[str], h0: Optional[str], ht: str,
                        cg: Optional[str] = None, n_seg: int, B: int, H: int, K: int, V: int,
                        cfg: dict, keep_hs: bool = False) -> Launch:
    """The scan over segment summaries: ``hs [n_seg, B, H, K, V]`` (each segment's state
    from a zero start) and ``gt [n_seg, B, H, K]`` (their summed log decays; ``None``
    ungated) from ``h0`` (``None``: zeros) to the end state ``ht``; ``cg`` (``[n_seg + 1,
    B, H, K]``): also the log decay from the start to each segment's start.  ``hs`` is
    overwritten with each segment's incoming state unless ``keep_hs`` (the output walks
    still fold the summaries themselves)."""
    BV = min(cfg["BV"], pow2(V))
    args = (("hs", "buf", hs), ("gt", "buf", gt or hs), ("h0", "buf", h0 or ht),
            ("ht", "buf", ht), ("NSEG", "i32", n_seg))
    const = (("K", K), ("V", V), ("BK", pow2(K)), ("BV", BV), ("GATED", gt is not None),
             ("HAS_H0", h0 is not None), ("STORE_CG", cg is not None))
    if cg is not None:
        args = args + (("cg", "buf", cg),)
    else:
        const = const + (("cg", None),)
    if keep_hs:  # set only when on (the same compiled kernel as before the flag existed)
        const = const + (("KEEP_HS", True),)
    return Launch("segment_scan", (cdiv(V, BV), B * H, 1), args, const, cfg["num_warps"],
                  cfg["num_stages"])


def gate_cumsum_launch(*, g: str, gc: str, B: int, T: int, H: int, BT: int,
                       maps=None) -> Launch:
    """The scalar gates' chunk-local cumulative sums: ``g [B, T, H]`` -> ``gc [B, H, T]``
    fp32 (what the walker reads for ``gate=1``), through ``maps["g"]`` when given."""
    return Launch("gate_cumsum", (cdiv(T, BT), B, 1),
                  (("g", "buf", g), ("gc", "buf", gc), ("T", "i32", T)),
                  (("H", H), ("BT", BT), ("BH", pow2(H))) + map_consts(maps, "g"),
                  GATE_CUMSUM_WARPS, 1)


def gate_cumsum(buffers: Dict[str, Buffer], *, B: int, T: int, H: int, BT: int, maps=None,
                role: str = "workspace") -> Launch:
    """:func:`gate_cumsum_launch` from buffer ``g`` into a new buffer ``g_cum`` of ``role``
    (added to ``buffers``)."""
    buffers["g_cum"] = Buffer((B, H, T), torch.float32, role)
    return gate_cumsum_launch(g="g", gc="g_cum", B=B, T=T, H=H, BT=BT, maps=maps)


def matrix_buffers(*, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
                   store_o: bool, has_h0: bool) -> Dict[str, Buffer]:
    """The buffers every matrix-state forward program has: inputs ``q, k [B, T, H, K]``,
    ``v [B, T, H, V]`` (``dtype``), ``h0 [B, H, K, V]`` fp32 (``has_h0``); outputs ``ht
    [B, H, K, V]`` fp32 and ``o [B, T, H, V]`` (``dtype``, ``store_o``)."""
    bufs = {"q": Buffer((B, T, H, K), dtype, "input"), "k": Buffer((B, T, H, K), dtype, "input"),
            "v": Buffer((B, T, H, V), dtype, "input"),
            "ht": Buffer((B, H, K, V), torch.float32, "output")}
    if store_o:
        bufs["o"] = Buffer((B, T, H, V), dtype, "output")
    if has_h0:
        bufs["h0"] = Buffer((B, H, K, V), torch.float32, "input")
    return bufs


# ``summary=`` of :func:`walk_launches` (and the patterns' ``forward_program``): what a
# sequence-parallel rank needs besides its outputs
NO_SUMMARY = "none"  # outputs only (one device, or the last rank)
SEGMENTS = "segments"  # the segment summaries ``hs, gt`` stay readable for the state pass
FOLDED = "folded"  # also their fold: the shard's ``delta`` and log decays ``cg``
SUMMARIES = (NO_SUMMARY, SEGMENTS, FOLDED)
# the delta rule's (forge_dist/kernels/delta.py): the shard's ``delta`` alone (rank 0 with
# no initial state, whose dense transition nobody needs); FOLDED there is ``delta`` and ``M``
STATE = "state"


def walk_launches(buffers: Dict[str, Buffer], *, q, k, v, g, w, h0, o, ht, B: int, T: int,
                  H: int, K: int, V: int, gate: int, scale: float, cfg: dict, prec: str,
                  a=None, n_seg: int = 1, maps=None, raw_gates: bool = False, hc=None,
                  vn=None, summary: str = NO_SUMMARY) -> List[Launch]:
    """The walker's schedule: one fused launch, or (``n_seg > 1``) the segment summaries
    then either the output walks that fold the segment scan in (``q`` given) or the segment
    scan alone.  The decoupled schedule's workspaces ``hs [n_seg, B, H, K, V]`` and (gated)
    ``gt [n_seg, B, H, K]`` fp32 are added to ``buffers``.  ``hc, vn``: fused only (see
    :func:`walk_launch`).

    ``summary`` (with outputs): ``SEGMENTS`` keeps the decoupled form even for one segment,
    so that the last two launches are always the summaries and the output walks, and a
    sequence-parallel rank's state pass goes between them, reading ``hs, gt`` (the output
    walks take the incoming state as ``h0``).  ``FOLDED`` adds, before the output walks, the
    scan of the summaries into the shard's own state ``delta [B, H, K, V]`` and log decays
    ``cg [n_seg + 1, B, H, K]`` (row ``n_seg``: the total), for state passes that take
    ``(M, delta)`` (the baselines)."""
    if summary not in SUMMARIES:
        raise ValueError(f"summary: expected one of {SUMMARIES}, got {summary!r}")
    if summary != NO_SUMMARY and q is None:
        raise ValueError("summary: the sequence-parallel forms need the outputs (q)")
    seg = segment_length(T, cfg["BT"], n_seg)
    n_seg = max(1, cdiv(T, seg))
    common = dict(k=k, v=v, g=g, w=w, B=B, T=T, H=H, K=K, V=V, gate=gate, scale=scale,
                  cfg=cfg, prec=prec, seg=seg, maps=maps, raw_gates=raw_gates)
    if n_seg == 1 and summary == NO_SUMMARY:
        return [walk_launch(q=q, h0=h0, o=o, ht=ht, gt=None, n=1, a=a, hc=hc, vn=vn,
                            **common)]
    if hc is not None:
        raise ValueError("walk: chunk_states needs the fused schedule (n_seg=1)")
    buffers["hs"] = Buffer((n_seg, B, H, K, V), torch.float32, "workspace")
    gt = None
    if gate:
        gt = "gt"
        buffers["gt"] = Buffer((n_seg, B, H, K), torch.float32, "workspace")
    launches = [walk_launch(q=None, h0=None, o=None, ht="hs", gt=gt, n=n_seg, **common)]
    if summary == FOLDED:
        buffers["delta"] = Buffer((B, H, K, V), torch.float32, "workspace")
        if gt:  # ungated: the transition is the identity, no log decays to fold
            buffers["cg"] = Buffer((n_seg + 1, B, H, K), torch.float32, "workspace")
        launches.append(segment_scan_launch(hs="hs", gt=gt, h0=None, ht="delta",
                                            cg="cg" if gt else None, n_seg=n_seg, B=B, H=H,
                                            K=K, V=V, cfg=cfg, keep_hs=True))
    if q is not None:  # the output walks fold the segment scan in
        launches.append(walk_launch(q=q, h0="hs", o=o, ht=ht, gt=gt, n=n_seg, a=a, s_in=h0,
                                    scan_in=True, **common))
        return launches
    launches.append(segment_scan_launch(hs="hs", gt=gt, h0=h0, ht=ht, n_seg=n_seg, B=B, H=H,
                                        K=K, V=V, cfg=cfg))
    return launches

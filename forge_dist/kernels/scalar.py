"""Matrix state with scalar (or no) decay: linear_attn (no gate) and simple_gla (``g [B,T,H]``).

Both schedules run the shared walker (:mod:`.walker`): FUSED, one program per
``(batch, head, V tile)`` over the whole sequence; DECOUPLED, the sequence cut into segments
(summaries in parallel, a scan over segments, outputs in parallel).  The scheduler
(:mod:`.scheduler`) picks the schedule and the segment count per shape.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import scheduler
from .compat import dot_precision, ensure, env_tiles, next_pow2, sized_config
from .ir import Buffer, Launch, Program, pow2
from .scalar_backward import scalar_decay_backward
from .walker import outputs_from_summary, sum_gates_in_walk, summarize, walk
from .walker_launches import (NO_SUMMARY, SUMMARY_KEYS, gate_cumsum, matrix_buffers,
                              walk_launches)
from .work import DecayAttentionWork

# Tile config for this pattern (one place).  BV trades parallelism (B*H*V/BV programs)
# against re-reading q, k once per V tile.  Measured on H200 at T=64K, B=1, H=32, K=V=128
# (results/kernel_profile_sweeps_NVIDIA-H200_2026-11-24.json): BV=64, 4 warps, 2 stages:
# simple_gla 1.48 ms, linear_attn 0.97 ms; 3 stages 2.06 / 0.99 (140 KB of shared memory,
# one program per SM instead of two); BV=32 2.11 / 1.32; 8 warps 2.68 / 1.70.
# The summary walks (k and v only, no q or outputs) take their own V tile and stages for
# 16-bit operands at K <= 128 (overridable for tuning with FORGE_DIST_SUMMARY_TILES,
# "BV=64,num_stages=2"; fp32 k and v tiles of three stages at BV=128 would need about
# 192 KB of shared memory): BV=128 with three stages streams k and v at the device's copy
# rate.  One H100, B=4, T=32K, one segment: 0.695 ms against 0.829 for the walk's tiles
# (results/kernel_profile_summary-tiles_NVIDIA-H100-80GB-HBM3_2026-11-28.json); one H200,
# in the segments that sequence-parallel (B=4, 32K, 4) and one-GPU (B=1, 64K, 8) runs walk:
# 0.501 against 0.550-0.558 ms and 0.259 against 0.306 for BV=64 with three stages
# (results/kernel_profile_summary-stages-*_NVIDIA-H200_2026-11-28.json).
FUSED_CONFIG = {"BT": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
SUMMARY_TILES = {"summary_BV": 128, "summary_stages": 3}


def fused_config(K: int, V: int, dtype: Optional[torch.dtype] = None) -> dict:
    """The walker's tiles for this pattern, head dims and operand ``dtype`` (``None``: no
    summary tiles of their own)."""
    cfg = sized_config(FUSED_CONFIG, K)
    if dtype in (torch.bfloat16, torch.float16) and next_pow2(K) <= 128:
        cfg.update(SUMMARY_TILES)
    for key, n in env_tiles("FORGE_DIST_SUMMARY_TILES").items():
        cfg[SUMMARY_KEYS[key]] = n
    return cfg


def forward_program(*, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
                    gated: bool, has_h0: bool, store_o: bool = True, scale: float, prec: str,
                    execution: Optional[str] = None, tiles: Optional[dict] = None,
                    gate_dtype: torch.dtype = torch.float32,
                    maps: Optional[Dict[str, Any]] = None,
                    summary: str = NO_SUMMARY) -> Program:
    """The launches of one segment forward (or, ``store_o=False``, its summary) as a
    :class:`~.ir.Program`: :func:`.walker_launches.matrix_buffers`, the gates ``g [B, T, H]``
    (``gate_dtype``, ``gated``), and the walker's schedule, fused or decoupled as the
    scheduler (or ``execution``) picks, after the gates' chunk sums where the walks do not
    sum the gates themselves (:func:`.walker.sum_gates_in_walk`).  ``tiles`` overrides
    entries of :func:`fused_config`; ``maps``: fused prologues by input name.  ``summary``: what a
    sequence-parallel rank also keeps for its state pass (:func:`.walker_launches.walk_launches`;
    the schedule then prices the summary in)."""
    cfg = dict(fused_config(K, V, dtype), **(tiles or {}))
    if tiles and not any(key in tiles for key in SUMMARY_KEYS.values()):
        for key in SUMMARY_KEYS.values():  # tiles given: they serve every walk
            cfg.pop(key, None)
    sched = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], pow2(V)),
                               elem_size=torch.empty((), dtype=dtype).element_size(),
                               request=execution, with_summary=summary != NO_SUMMARY)
    bufs = matrix_buffers(B=B, T=T, H=H, K=K, V=V, dtype=dtype, store_o=store_o,
                          has_h0=has_h0)
    launches: list[Launch] = []
    g_walk, raw_gates = None, False
    if gated:
        bufs["g"] = Buffer((B, T, H), gate_dtype, "input")
        # short inputs sum the gates in the walks (one launch fewer), long ones read a gate
        # sum made before them
        raw_gates = sum_gates_in_walk(B, T, (maps or {}).get("g"))
        g_walk = "g"
        if not raw_gates:
            launches.append(gate_cumsum(bufs, B=B, T=T, H=H, BT=cfg["BT"], maps=maps))
            g_walk = "g_cum"
    launches += walk_launches(bufs, q="q" if store_o else None, k="k", v="v", g=g_walk,
                              w=None, h0="h0" if has_h0 else None,
                              o="o" if store_o else None, ht="ht", B=B, T=T, H=H, K=K, V=V,
                              gate=1 if gated else 0, scale=scale, cfg=cfg, prec=prec,
                              n_seg=sched.n_seg, maps=maps, raw_gates=raw_gates,
                              summary=summary)
    notes = [f"execution {sched.strategy} ({sched.n_seg} segments): {sched.reason}"]
    return Program(launches, bufs, sched.strategy, notes)


class ScalarDecayWork(DecayAttentionWork):
    """linear_attn / simple_gla segment: inputs ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``g [B, T, H]`` or ``None``."""

    def _prec(self):
        return dot_precision(self.in_dtype)

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1], k.dtype)
        gate = 0 if g is None else 1
        if self.segments is not None:  # the summary ran: only the output walks remain
            return outputs_from_summary(self.segments, k, v, q=q, g=g, gate=gate, S_in=S_in,
                                        scale=self.scale, out_dtype=self.out_dtype, cfg=cfg,
                                        prec=self._prec(), maps=self.maps)
        n_seg = self._schedule(k, v, cfg)
        return walk(k, v, q=q, g=g, gate=gate, h0=S_in, scale=self.scale,
                    out_dtype=self.out_dtype, cfg=cfg, prec=self._prec(), n_seg=n_seg,
                    maps=self.maps)

    def _summary_segments(self) -> int:
        k, v = self.tensors[1], self.tensors[2]
        return self._schedule(k, v, fused_config(k.shape[-1], v.shape[-1], k.dtype),
                              with_summary=True)

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1], k.dtype)
        n_seg = self._summary_segments()
        self.segments = summarize(k, v, g=g, gate=0 if g is None else 1, cfg=cfg,
                                  prec=self._prec(), n_seg=n_seg, maps=self.maps)
        M = None
        if need_M and g is not None:
            M = self.segments.total_log_decay()[..., 0].exp()  # [B, H]
        return self.segments.delta, M

    @staticmethod
    def chunk_backward(*args):
        """The Triton chunk backward (:func:`.scalar_backward.scalar_decay_backward`)."""
        return scalar_decay_backward(*args)

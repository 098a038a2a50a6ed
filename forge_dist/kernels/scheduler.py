"""Fused vs decoupled execution: Algorithm 1 of the Forge paper (appendix B.4).

FUSED keeps the state on chip and walks the chunks (``B * H * P_state`` programs); DECOUPLED
materialises chunk states in HBM (phase 1 parallel over chunks, a scan, a parallel merge).
The fast path prefers FUSED once its task count saturates the GPU; otherwise each candidate
segment count is priced by its HBM traffic over the bandwidth its (capped) parallelism draws,
with the per-chunk compute term set to 0 as in the paper (the kernels are memory bound).
DECOUPLED works on segments of several chunks (see :func:`algorithm1`).

The choice can be forced per call (``execution=``) or globally with the environment variable
``FORGE_DIST_EXECUTION=fused|decoupled``; ``FORGE_DIST_SEGMENTS=n`` fixes the segment count.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from ..config import env_positive_int

FUSED = "fused"
DECOUPLED = "decoupled"
CHOICES = (FUSED, DECOUPLED)
# a segment shorter than this many chunks re-reads k, v for too little parallelism
MIN_CHUNKS_PER_SEGMENT = 4
# relative estimate difference below which fewer segments win (see best_segments)
NEAR_TIE = 0.02


@dataclass(frozen=True)
class Device:
    """What Algorithm 1 needs of a device."""

    n_sm: int
    bandwidth: float  # bytes / s
    max_concurrency: int  # P_max: programs resident at once (SMs x blocks per SM)


@lru_cache(maxsize=None)
def device_params(index: Optional[int] = None) -> Device:
    """SM count and HBM bandwidth from the CUDA device properties (CPU: a nominal device)."""
    if not torch.cuda.is_available():
        return Device(n_sm=132, bandwidth=4.8e12, max_concurrency=132 * 2)
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    # DDR: two transfers per clock
    bw = 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else 3.35e12
    return Device(n_sm=props.multi_processor_count, bandwidth=bw,
                  max_concurrency=props.multi_processor_count * 2)


def forced() -> Optional[str]:
    """The strategy forced through ``FORGE_DIST_EXECUTION`` (or ``None``)."""
    env = os.environ.get("FORGE_DIST_EXECUTION", "").strip().lower()
    if env in ("", "auto"):
        return None
    if env not in CHOICES:
        raise ValueError(f"FORGE_DIST_EXECUTION: expected one of {CHOICES} or 'auto', got {env!r}")
    return env


def best_segments(p_fused: int, n_chunks: int, *, base: float, extra: float, state: float,
                  device: Device, t_comp_chunk: float = 0.0,
                  min_chunks: int = MIN_CHUNKS_PER_SEGMENT, with_summary: bool = False):
    """The segment count with the least estimated time, and every candidate's estimate.

    ``base``: bytes of one fused pass; ``extra``: bytes the segment summaries re-read;
    ``state``: bytes of one full state.  Candidates are powers of two keeping at least
    ``min_chunks`` chunks per segment; a program walking alone draws
    ``bandwidth / max_concurrency``, so time = traffic / (bandwidth * capped parallelism share).
    ``with_summary``: the caller needs the summary as well (sequence parallelism), which a
    fused run pays with the same extra read.
    """
    def cost(n: int) -> float:
        par = min(p_fused * n, device.max_concurrency)
        traffic = base + (extra if n > 1 or with_summary else 0) + (4 * n * state if n > 1 else 0)
        steps = n_chunks / n + (n if n > 1 else 0)  # sequential chunk steps (+ the scan)
        return traffic / (device.bandwidth * par / device.max_concurrency) + t_comp_chunk * steps

    candidates = [1]
    n = 2
    while n <= n_chunks // max(1, min_chunks):
        candidates.append(n)
        n *= 2
    costs = {n: cost(n) for n in candidates}
    # the fewest segments within NEAR_TIE of the least estimate: past saturation the model
    # sees only the state traffic, not the scan step and the launch each segment adds
    least = min(costs.values())
    return min(n for n in candidates if costs[n] <= least * (1 + NEAR_TIE)), costs


def algorithm1(B: int, T: int, H: int, dk: int, dv: int, C: int, tk: int, tv: int, *,
               elem_size: int = 2, device: Optional[Device] = None,
               p_min: Optional[int] = None, t_comp_chunk: float = 0.0,
               gate_elems: int = 0, min_chunks: int = MIN_CHUNKS_PER_SEGMENT,
               with_summary: bool = False):
    """Algorithm 1 with DECOUPLED at segment granularity; returns ``(strategy, details)``.

    The paper's DECOUPLED materialises every chunk's state.  Here a *segment* of several
    chunks is the unit: ``n_seg`` segments cost one extra read of k, v (and gates) plus four
    passes over ``n_seg`` fp32 states, and multiply the parallelism by ``n_seg``.  One chunk
    per segment is the paper's DECOUPLED; one segment is FUSED.  Each candidate's time is its
    HBM traffic over the bandwidth its (capped) parallelism can draw: a program walking
    chunks alone draws ``bandwidth / max_concurrency``.  ``details['n_seg']`` is the choice.
    """
    dev = device or device_params()
    p_min = dev.n_sm if p_min is None else p_min
    n_c = max(1, math.ceil(T / C))
    p_state = math.ceil(dk / tk) * math.ceil(dv / tv)
    p_fused = B * H * p_state
    info = {"P_fused": p_fused, "P_min": p_min, "N_sm": dev.n_sm, "bandwidth": dev.bandwidth,
            "n_seg": 1}
    if p_fused >= p_min:
        info["reason"] = "fused saturates the SMs"
        return FUSED, info
    # bytes: q, k, v, o (+ gates) once; DECOUPLED adds k, v (+ gates) and 4 state passes
    tokens = B * H * T
    best, costs = best_segments(
        p_fused, n_c, base=tokens * ((2 * dk + 2 * dv) * elem_size + gate_elems * 4),
        extra=tokens * ((dk + dv) * elem_size + gate_elems * 4), state=B * H * dk * dv * 4,
        device=dev, t_comp_chunk=t_comp_chunk, min_chunks=min_chunks,
        with_summary=with_summary)
    info.update(t_fused=costs[1], t_dec=costs.get(best, costs[1]), n_seg=best,
                P_dec=p_fused * best, candidates=costs)
    if best == 1:
        info["reason"] = "fused estimated faster"
        return FUSED, info
    info["reason"] = f"decoupled over {best} segments estimated faster"
    return DECOUPLED, info


@dataclass(frozen=True)
class Schedule:
    """How one call runs: ``strategy`` (fused/decoupled), ``n_seg`` segments, and why."""

    strategy: str
    n_seg: int
    reason: str


def _env_segments() -> Optional[int]:
    return env_positive_int("FORGE_DIST_SEGMENTS")


def _resolve(request: Optional[str], n_c: int, auto: Schedule) -> Schedule:
    """Apply ``request`` > ``FORGE_DIST_EXECUTION`` > ``FORGE_DIST_SEGMENTS`` > ``auto``."""
    want = request if request not in (None, "auto") else forced()
    if want is not None and want not in CHOICES:
        raise ValueError(f"execution: expected one of {CHOICES}, got {want!r}")
    env_n = _env_segments()
    if want == FUSED:
        return Schedule(FUSED, 1, "forced")
    if want == DECOUPLED:
        n = max(1, min(env_n if env_n else max(2, auto.n_seg), n_c))
        if n == 1:  # report what runs: one segment is the fused walk
            return Schedule(FUSED, 1, "decoupled forced, but one segment (one chunk) is fused")
        return Schedule(DECOUPLED, n, "forced")
    if env_n:
        n = max(1, min(env_n, n_c))
        return Schedule(FUSED if n == 1 else DECOUPLED, n, "FORGE_DIST_SEGMENTS")
    return auto


def schedule(B: int, T: int, H: int, K: int, V: int, C: int, tv: int, *, elem_size: int = 2,
             gate_elems: int = 0, request: Optional[str] = None,
             decoupled_available: bool = True, with_summary: bool = False) -> Schedule:
    """The schedule of one matrix-state call: ``request`` > ``FORGE_DIST_EXECUTION`` >
    Algorithm 1 (``FORGE_DIST_SEGMENTS`` fixes the segment count of a decoupled run).

    A forced DECOUPLED takes Algorithm 1's segment count (at least 2, at most one per chunk).
    Patterns without a decoupled schedule always run fused.  ``with_summary``: the shard
    summary is needed too (a sequence-parallel rank), which makes segments cheaper relative
    to the fused walk (both read k and v twice).
    """
    if not decoupled_available:
        _resolve(request, 1, Schedule(FUSED, 1, ""))  # still validate the request
        return Schedule(FUSED, 1, "decoupled not built for this pattern")
    # the state tile spans all of K (tk = K) and BV columns
    strategy, info = algorithm1(B, T, H, K, V, C, K, tv, elem_size=elem_size,
                                gate_elems=gate_elems, with_summary=with_summary)
    auto = Schedule(strategy, info["n_seg"], info["reason"])
    n_c = max(1, math.ceil(T / C))
    if with_summary and strategy == FUSED:
        # A sequence-parallel rank's summary walk is on the critical path (the next rank
        # waits for it), and alone it is a light walk that one program per (b, h, V tile)
        # leaves latency bound: cut it into segments until they fill the device twice
        # over (the output walks, which fold the segments in, cost about the fused walk).
        dev = device_params()
        n, cap = 1, max(1, n_c // MIN_CHUNKS_PER_SEGMENT)
        while info["P_fused"] * n < 2 * dev.max_concurrency and n * 2 <= cap:
            n *= 2
        if n > 1:
            auto = Schedule(DECOUPLED, n, f"decoupled over {n} segments: the summary of a "
                            "sequence-parallel rank is on the critical path")
    return _resolve(request, n_c, auto)


# The HGRN kernel is small (one warp, no shared memory) and latency bound: each step waits
# for its block of tokens, so segments (more programs walking fewer steps) are what fills
# the GPU.  Measured on H200 at [1, T, 4096] bf16, 8 tokens per step, 256 channels per
# program (results/kernel_profile_hgrn*_2026-11-24): the best segment counts were 16 at
# T = 1K (64 tokens each), 32 at 4K and 64 at 64K (1024 programs, 665 us; 128 segments
# 734 us, 32 segments 773 us): about 1024 programs fill the 132 SMs, so 7 per SM saturate.
# A segment keeps at least VECTOR_STATE_MIN_TOKENS tokens: the scan over segments walks
# them one by one.
VECTOR_STATE_RESIDENT_PER_SM = 7
VECTOR_STATE_MIN_TOKENS = 64
# The backward's reverse walk (2 tokens per step, more loads per step) kept gaining to 128
# segments at 64K (2048 programs: 1.94 ms for recompute + walk, 64 segments 2.33 ms).
VECTOR_STATE_BWD_RESIDENT_PER_SM = 14


def schedule_vector_state(B: int, T: int, D: int, C: int, td: int, *, elem_size: int = 2,
                          request: Optional[str] = None,
                          device: Optional[Device] = None,
                          with_summary: bool = False,
                          resident_per_sm: int = VECTOR_STATE_RESIDENT_PER_SM) -> Schedule:
    """The schedule of one vector-state (HGRN) call: ``B * cdiv(D, td)`` fused programs; the
    segment summaries re-read x and g (as the summary of a sequence-parallel rank does).
    Concurrency is ``resident_per_sm`` programs per SM (a small kernel; the backward passes
    ``VECTOR_STATE_BWD_RESIDENT_PER_SM``)."""
    dev = device or device_params()
    dev = Device(dev.n_sm, dev.bandwidth, dev.n_sm * resident_per_sm)
    n_c = max(1, math.ceil(T / C))
    p_fused = B * math.ceil(D / td)
    if p_fused >= dev.max_concurrency:
        auto = Schedule(FUSED, 1, "fused saturates the SMs")
    else:
        tokens = B * T * D
        best, _ = best_segments(p_fused, n_c, base=3 * tokens * elem_size,
                                extra=2 * tokens * elem_size, state=B * D * 4, device=dev,
                                with_summary=with_summary,
                                min_chunks=max(MIN_CHUNKS_PER_SEGMENT,
                                               VECTOR_STATE_MIN_TOKENS // max(1, C)))
        auto = (Schedule(FUSED, 1, "fused estimated faster") if best == 1 else
                Schedule(DECOUPLED, best, f"decoupled over {best} segments estimated faster"))
    return _resolve(request, n_c, auto)


def choose(B: int, T: int, H: int, K: int, V: int, C: int, tv: int, *, elem_size: int = 2,
           request: Optional[str] = None, decoupled_available: bool = True):
    """``(strategy, reason)`` of :func:`schedule` (kept for callers that need no segments)."""
    s = schedule(B, T, H, K, V, C, tv, elem_size=elem_size, request=request,
                 decoupled_available=decoupled_available)
    return s.strategy, s.reason

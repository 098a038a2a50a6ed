"""Fused vs decoupled execution: Algorithm 1 of the Forge paper (appendix B.4).

FUSED keeps the state on chip and walks the chunks (``B * H * P_state`` programs); DECOUPLED
materialises chunk states in HBM (phase 1 parallel over chunks, a scan, a parallel merge).
The fast path prefers FUSED once its task count saturates the GPU; otherwise both are priced
by their GMEM traffic per chunk spread over their (capped) parallelism, with the per-chunk
compute term set to 0 as in the paper (the kernels are memory bound).

The choice can be forced per call (``execution=``) or globally with the environment variable
``FORGE_DIST_EXECUTION=fused|decoupled``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

FUSED = "fused"
DECOUPLED = "decoupled"
CHOICES = (FUSED, DECOUPLED)


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


def algorithm1(B: int, T: int, H: int, dk: int, dv: int, C: int, tk: int, tv: int, *,
               elem_size: int = 2, device: Optional[Device] = None,
               p_min: Optional[int] = None, t_comp_chunk: float = 0.0):
    """Algorithm 1; returns ``(strategy, details dict)``."""
    dev = device or device_params()
    p_min = dev.n_sm if p_min is None else p_min
    n_c = math.ceil(T / C)
    p_state = math.ceil(dk / tk) * math.ceil(dv / tv)
    p_dec = B * H * n_c * p_state
    p_fused = B * H * p_state
    gmem_dec = (2 * C * (dk + dv) + 5 * dk * dv) * elem_size
    gmem_fused = (2 * C * (dk + dv) + 4 * dk * dv) * elem_size
    info = {"P_fused": p_fused, "P_dec": p_dec, "P_min": p_min, "N_sm": dev.n_sm,
            "bandwidth": dev.bandwidth}
    if p_fused >= p_min:
        info["reason"] = "fused saturates the SMs"
        return FUSED, info
    pd = min(p_dec, dev.max_concurrency)
    pf = min(p_fused, dev.max_concurrency)
    t_dec = gmem_dec / (dev.bandwidth * pd) + t_comp_chunk / pd
    t_fused = gmem_fused / (dev.bandwidth * pf) + t_comp_chunk / pf
    info.update(t_dec=t_dec, t_fused=t_fused)
    if t_fused <= t_dec:
        info["reason"] = "fused estimated faster"
        return FUSED, info
    info["reason"] = "decoupled estimated faster"
    return DECOUPLED, info


def choose(B: int, T: int, H: int, K: int, V: int, C: int, tv: int, *, elem_size: int = 2,
           request: Optional[str] = None, decoupled_available: bool = True):
    """The strategy for one call: ``request`` > ``FORGE_DIST_EXECUTION`` > Algorithm 1.

    Returns ``(strategy, reason)``.  Patterns without a decoupled kernel always run fused.
    """
    want = request if request not in (None, "auto") else forced()
    if want is not None:
        if want not in CHOICES:
            raise ValueError(f"execution: expected one of {CHOICES}, got {want!r}")
        if want == DECOUPLED and not decoupled_available:
            return FUSED, "decoupled not built for this pattern"
        return want, "forced"
    if not decoupled_available:
        return FUSED, "decoupled not built for this pattern"
    # the state tile spans all of K (tk = K) and BV columns
    strategy, info = algorithm1(B, T, H, K, V, C, K, tv, elem_size=elem_size)
    return strategy, info["reason"]

"""What ``strategy="auto"`` picks among the GPU-initiated passes: the chain (``forge``), the
log-depth ``scan`` and ``hier``, by the predicted time of the state pass.

The model is the one of ``scaling_benchmarks/cost_model.py`` (docs/design.md section 10),
cut to what the choice needs: a state of ``S`` bytes (and, for the log-depth passes, its
transition of ``Mb`` bytes) cut into tiles that stream through a route of links, each link a
GPU-initiated put plus the tile's share of a combine on the receiving GPU; the latencies add
up, the bytes cross the slowest link once.

* ``forge``: ``P - 1`` links in rank order, a link across nodes where consecutive ranks sit
  on different nodes;
* ``scan``: ``ceil(log2 P)`` rounds, each across nodes once the ranks span several;
* ``hier``: ``ceil(log2 L)`` rounds in the node, ``ceil(log2 N)`` across, one back in.

A log-depth round composes whole summaries (the state and its transition), twice a chain's
combine, plus the ``K x K`` product per head for dense transitions.  Every hop or round
after the first also waits for its partner's program (the ranks' skew), which the 4-rank
runs measured at about 43 us a hop and 95 us a round.  The parameters are the cost model's
defaults (``configs/cost_model.toml``; a test keeps the two equal): the in-node ones
measured on 2 and 4 x H200 (an NVSHMEM put of 8 MiB in 29.5 us), the network's assumed for
InfiniBand NDR (one 400 Gb/s NIC per GPU), not measured here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..variants.transitions import Kind


@dataclass(frozen=True)
class Link:
    """A GPU-initiated put: ``latency_us + bytes / GBps``."""

    latency_us: float
    GBps: float


IN_NODE = Link(latency_us=2.0, GBps=305.0)     # NVLink (cost model: nvlink.dev_*)
ACROSS_NODES = Link(latency_us=15.0, GBps=35.0)  # InfiniBand NDR (cost model: ib.dev_*)
HBM_GBPS = 4000.0       # the combine's memory traffic (cost model: hardware.hbm_GBps)
FP32_TFLOPS = 50.0      # dense transitions' products (hardware.fp32_tflops)
KERNEL_LAUNCH_US = 5.0  # (hardware.kernel_launch_us)
N_SMS = 132             # tiles combined in parallel (hardware.n_sms)
TILE_BYTES = 16 * 1024  # forge's tile (forge.tile_kib)
# what each hop of the chain / each round of scan and hier after the first costs beyond its
# put and combine: the waiting program's latency and the ranks' skew, fitted on one growth,
# simple_gla's forward from 2 to 4 x H200 (forge.hop_skew_us, forge.round_skew_us)
HOP_SKEW_US = 43.3
ROUND_SKEW_US = 95.4

PASSES = ("forge", "scan", "hier")


def sizes(kind: Kind, B: int, H: int, K: int, V: int) -> Tuple[float, float]:
    """fp32 bytes of a state ``[B, H, K, V]`` and of its transition."""
    m = {Kind.IDENTITY: 0, Kind.SCALAR: B * H, Kind.DIAGONAL: B * H * K,
         Kind.DENSE: B * H * K * K}[kind]
    return 4.0 * B * H * K * V, 4.0 * m


def combine_us(kind: Kind, B: int, H: int, K: int, V: int) -> float:
    """One combine ``M S + d`` of a whole state on one GPU."""
    S, Mb = sizes(kind, B, H, K, V)
    mem = (3 * S + Mb) / (HBM_GBPS * 1e3)
    if kind is not Kind.DENSE:
        return KERNEL_LAUNCH_US + mem
    return KERNEL_LAUNCH_US + max(2.0 * B * H * K * K * V / (FP32_TFLOPS * 1e6), mem)


def route(strategy: str, layout: Sequence[Sequence[int]]) -> List[Link]:
    """The links the last state crosses, in order, for ``layout`` (the group's ranks by
    node, :func:`forge_dist.sp.hier.nodes`)."""
    node_of = {r: n for n, members in enumerate(layout) for r in members}
    P, N = len(node_of), len(layout)
    if strategy == "forge":
        return [ACROSS_NODES if node_of[r] != node_of[r + 1] else IN_NODE for r in range(P - 1)]
    if strategy == "scan":
        return [ACROSS_NODES if N > 1 else IN_NODE] * math.ceil(math.log2(P))
    if strategy == "hier":
        widest = max(len(m) for m in layout)
        inside = [IN_NODE] * math.ceil(math.log2(widest))
        return inside if N == 1 else inside + [ACROSS_NODES] * math.ceil(math.log2(N)) + [IN_NODE]
    raise ValueError(f"strategy: expected one of {PASSES}, got {strategy!r}")


def pass_us(strategy: str, layout: Sequence[Sequence[int]], kind: Kind, B: int, H: int, K: int,
            V: int) -> float:
    """Predicted time from the summaries' end to the last rank's incoming state, in us."""
    links = route(strategy, layout)
    if not links:
        return 0.0
    S, Mb = sizes(kind, B, H, K, V)
    comb = combine_us(kind, B, H, K, V)
    nbytes = S
    if strategy != "forge":  # a round composes whole summaries: the state and its transition
        nbytes = S + Mb
        comb = 2 * comb * (1.0 + (K / V if kind is Kind.DENSE else 0.0))
    tile = min(nbytes, TILE_BYTES)
    n_tiles = max(1.0, nbytes / tile)
    tile_comb = (comb - KERNEL_LAUNCH_US) * min(n_tiles, N_SMS) / n_tiles
    slowest = min(link.GBps for link in links)
    skew = HOP_SKEW_US if strategy == "forge" else ROUND_SKEW_US
    return (KERNEL_LAUNCH_US
            + sum(link.latency_us + tile / (link.GBps * 1e3) + tile_comb for link in links)
            + skew * (len(links) - 1)
            + (nbytes - tile) / (slowest * 1e3))


def pick(layout: Sequence[Sequence[int]], kind: Kind, B: int, H: int, K: int,
         V: int) -> Tuple[str, Dict[str, float]]:
    """``(the fastest predicted pass, {pass: predicted us})``; ties go to the chain, then
    ``scan`` (fewer kinds of rounds)."""
    times = {s: pass_us(s, layout, kind, B, H, K, V) for s in PASSES}
    best = min(PASSES, key=lambda s: (round(times[s], 6), PASSES.index(s)))
    return best, times

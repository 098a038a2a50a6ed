"""The sequence-parallel part of a plan: strategy, state workspaces, channels, agreement.

Run once when a plan is made for a group of more than one rank (:func:`setup`): the
strategy object, the state buffers the chain reuses every call, forge's symmetric buffers
(their allocation is a collective) and the check that every rank planned the same call.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import kernels, sp
from ..sp import agreement, forge
from ..variants import registry
from ..variants.transitions import Kind
from .plan import Plan, PlanError


def sp_variants() -> Tuple[str, ...]:
    """The ops with sequence-parallel plans: matrix states with an identity, scalar or
    diagonal transition (the summary programs of the delta rule's dense one are not
    built)."""
    return kernels.sp_summary_variants()


def resolve_strategy(strategy: str, simulated: bool, device: torch.device, group=None):
    """``(name, strategy object)`` of a sequence-parallel plan's ``strategy`` argument on
    ``group``."""
    if simulated:
        if strategy not in ("auto", "forge"):
            raise PlanError(f"strategy={strategy!r}: a SimRank group runs only 'forge' (the "
                            "simulated transport)")
        return "forge", forge.FORGE
    if strategy not in sp.names():
        raise PlanError(f"strategy: expected one of {sp.names()}, got {strategy!r}")
    try:
        obj = sp.resolve(strategy, device, group)
    except (ValueError, RuntimeError) as err:
        raise PlanError(str(err)) from None
    return obj.name, obj


def setup(p: Plan, simulated: bool, B, T, H, K, V, dtype, gated) -> None:
    """State workspaces, forge channels and the cross-rank agreement check of a
    sequence-parallel plan ``p`` (its strategy already set, :func:`resolve_strategy`)."""
    p.s_in = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    p.zeros = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    if not simulated:
        # once per plan, not per run: every rank must have planned the same call.  The
        # fields are the ops' (a rank on the runner sends the same word as one on a plan);
        # the word travels with every run's state and is checked on the device.
        kind = registry.get(p.op).kind
        names = agreement.GATE_NAMES  # as the ops name them: none, g, g per channel
        gates = names[0] if kind is Kind.IDENTITY or not gated else (
            names[2] if kind is Kind.DIAGONAL else names[1])
        fields = agreement.op_fields(p.op, B=B, T=T, dims={"H": H, "K": K, "V": V},
                                     dtype=dtype, strategy=p.strategy, gates=gates,
                                     offsets=0, grad=p.train)
        _, p.word = agreement.agree(p.group, p.device, fields)
    if p.strategy == "forge":
        # symmetric buffers now: their allocation is a collective (NVSHMEM)
        ch, bk, bv = forge._channel(forge._Where(p.group), "fwd", p.s_in, Kind(p.kind))
        p.channels = {"direction": "fwd", "tile": [bk, bv], "tiles": int(ch.sig.numel()),
                      "transport": "sim" if simulated else "nvshmem"}

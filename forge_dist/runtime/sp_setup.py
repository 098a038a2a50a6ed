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
    return tuple(n for n in kernels.matrix_variants() if registry.get(n).kind is not Kind.DENSE)


def setup(p: Plan, strategy: str, simulated: bool, B, T, H, K, V, dtype, gated) -> None:
    """Strategy, state workspaces, forge channels and the cross-rank agreement check of a
    sequence-parallel plan ``p`` (set on it)."""
    p.delta = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    p.zeros = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    if simulated:
        if strategy not in ("auto", "forge"):
            raise PlanError(f"strategy={strategy!r}: a SimRank group runs only 'forge' (the "
                            "simulated transport)")
        p.strategy, p.strategy_obj = "forge", forge.FORGE
    else:
        if strategy not in sp.names():
            raise PlanError(f"strategy: expected one of {sp.names()}, got {strategy!r}")
        try:
            p.strategy_obj = sp.resolve(strategy, p.device)
        except (ValueError, RuntimeError) as err:
            raise PlanError(str(err)) from None
        p.strategy = p.strategy_obj.name
        # once per plan, not per run: every rank must have planned the same call.  The
        # fields are the ops' (a rank on the runner sends the same word as one on a plan);
        # the word travels with every run's state and is checked on the device.
        kind = registry.get(p.op).kind
        names = agreement.GATE_NAMES  # as the ops name them: none, g, g per channel
        gates = names[0] if kind is Kind.IDENTITY or not gated else (
            names[2] if kind is Kind.DIAGONAL else names[1])
        fields = agreement.op_fields(p.op, B=B, T=T, dims={"H": H, "K": K, "V": V},
                                     dtype=dtype, strategy=p.strategy, gates=gates,
                                     offsets=0, grad=False)
        _, p.word = agreement.agree(p.group, p.device, fields)
    if p.strategy == "forge":
        # symmetric buffers now: their allocation is a collective (NVSHMEM)
        ch, bk, bv = forge._channel(forge._Where(p.group), "fwd", p.delta, Kind(p.kind))
        p.channels = {"direction": "fwd", "tile": [bk, bv], "tiles": int(ch.sig.numel()),
                      "transport": "sim" if simulated else "nvshmem"}

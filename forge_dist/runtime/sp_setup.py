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
    """The ops with sequence-parallel plans, for inference and training (``train=True``,
    :mod:`.sp_train`): every op."""
    return kernels.sp_summary_variants()


def summary_form(op: str, rank: int, initial_state: bool, train: bool, strategy_obj) -> str:
    """What the forward program of a rank before the last keeps for the state pass
    (``summary=`` of :func:`forge_dist.kernels.forward_program`): a training plan's ranks
    the folded summary whatever the strategy; the delta rule's the shard's state and
    dense transition (``"folded"``), or on rank 0 without an initial state the state alone
    (``"state"``: it starts from zero, so nobody needs its transition); else the
    strategy's :attr:`~forge_dist.sp.base.Strategy.plan_summary`."""
    if registry.get(op).kind is Kind.DENSE:
        return "state" if rank == 0 and not initial_state else "folded"
    return "folded" if train else strategy_obj.plan_summary


def resolve_strategy(strategy: str, simulated: bool, device: torch.device, group=None, *,
                     kind=None, state=None):
    """``(name, strategy object)`` of a sequence-parallel plan's ``strategy`` argument on
    ``group`` (``kind`` and the state's ``(B, H, K, V)`` price ``auto``'s choice, as the ops
    do)."""
    if simulated:
        if strategy not in ("auto", "forge"):
            raise PlanError(f"strategy={strategy!r}: a SimRank group runs only 'forge' (the "
                            "simulated transport)")
        return "forge", forge.FORGE
    if strategy not in sp.names():
        raise PlanError(f"strategy: expected one of {sp.names()}, got {strategy!r}")
    try:
        obj = sp.resolve(strategy, device, group, kind=kind, state=state)
    except (ValueError, RuntimeError) as err:
        raise PlanError(str(err)) from None
    return obj.name, obj


def setup(p: Plan, simulated: bool, B, T, H, K, V, dtype, gated, dims=None) -> None:
    """State workspaces, forge channels and the cross-rank agreement check of a
    sequence-parallel plan ``p`` (its strategy already set, :func:`resolve_strategy`);
    the state is ``[B, H, K, V]`` (hgrn: ``[B, 1, D, 1]``, its ``dims`` ``{"D": D}`` as the
    op names them)."""
    p.s_in = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    p.zeros = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    if (Kind(p.kind) is Kind.DENSE and p.rank < p.size - 1
            and "M" not in p.finish_exec.workspaces):
        # rank 0 from zero walks no transition (summary "state"): the baselines' state pass
        # reads a zero one, which multiplies its zero start (forge's adds no product)
        p.finish_exec.workspaces["M_zero"] = torch.zeros(B, H, K, K, dtype=torch.float32,
                                                         device=p.device)
    if not simulated:
        # once per plan, not per run: every rank must have planned the same call.  The
        # fields are the ops' (a rank on the runner sends the same word as one on a plan);
        # the word travels with every run's state and is checked on the device.
        kind = registry.get(p.op).kind
        # as the ops name them: none, g, g per channel; the delta rule's "g, beta" or "beta"
        names = agreement.GATE_NAMES
        if registry.get(p.op).vector_state:
            gates = names[5]
        elif kind is Kind.DENSE:
            gates = names[3] if gated else names[4]
        else:
            gates = names[0] if kind is Kind.IDENTITY or not gated else (
                names[2] if kind is Kind.DIAGONAL else names[1])
        fields = agreement.op_fields(p.op, B=B, T=T, dims=dims or {"H": H, "K": K, "V": V},
                                     dtype=dtype, strategy=p.strategy, gates=gates,
                                     offsets=0, grad=p.train)
        _, p.word = agreement.agree(p.group, p.device, fields)
    if p.strategy == "forge":
        # symmetric buffers now: their allocation is a collective (NVSHMEM)
        ch, bk, bv = forge._channel(forge._Where(p.group), "fwd", p.s_in, Kind(p.kind))
        p.channels = {"direction": "fwd", "tile": [bk, bv], "tiles": int(ch.sig.numel()),
                      "transport": "sim" if simulated else "nvshmem"}

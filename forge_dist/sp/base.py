"""The inter-rank phase: strategies and the differentiable state pass that uses them.

Rank ``r`` holds the summary ``(M_r, dS_r)`` of its shard.  The forward chain is

    S_in(0) = S0,        S_in(r+1) = M_r S_in(r) + dS_r

and the backward chain runs the other way with the transposed transition: given ``g_r``, the
gradient of the loss with respect to ``S_in(r)`` through rank r's own outputs,

    lam(P-1) = g_{P-1},  lam(r) = g_r + M_r^T lam(r+1)

so that ``dL/d dS_r = lam(r+1)``, ``dL/dM_r = lam(r+1) S_in(r)^T`` (reduced by kind) and
``dL/dS0 = lam(0)``.  A strategy only decides how these chains travel between ranks.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..variants import transitions as tr
from ..variants.transitions import Kind
from . import choice, layout, p2p, phases


class Strategy:
    """How the forward and backward chains cross ranks.  Subclasses do no autograd."""

    name: str = ""

    def available(self, device: torch.device) -> Optional[str]:
        """``None`` when usable with tensors on ``device``, else the reason it is not."""
        return None

    def forward_chain(self, kind: Kind, M: Optional[Tensor], delta: Tensor, S0: Tensor,
                      group, word: int = 0, keep: Optional[dict] = None) -> Tuple[Tensor, Any]:
        """Return ``(S_in(r), saved)``; rank 0's ``S_in`` is ``S0``.

        ``M`` is ``None`` for the identity kind and may be ``None`` on the last rank, whose
        transition no other rank reads.  ``saved`` is handed back to :meth:`backward_chain`.
        ``word`` is the call's signature word (:mod:`forge_dist.sp.agreement`): it travels
        with the state, and a rank whose peer sent another word returns NaN and records an
        error that the next call (or :func:`forge_dist.sp.flush`) raises.  ``keep``: a
        plan's dict, where a strategy may keep buffers and launches from call to call (then
        ``S_in`` may be such a buffer, valid until the plan's next call); the others ignore it.
        """
        raise NotImplementedError

    def backward_chain(self, kind: Kind, M: Optional[Tensor], grad_in: Tensor, group,
                       saved: Any, word: int = 0, keep: Optional[dict] = None
                       ) -> Tuple[Tensor, Tensor]:
        """Given ``g_r`` return ``(lam(r+1), lam(r))`` (``lam(P) = 0``); ``keep`` as in
        :meth:`forward_chain` (``lam(r+1)`` may be a kept buffer)."""
        raise NotImplementedError

    # What a sequence-parallel plan's forward program keeps for :meth:`plan_forward`
    # (``summary=`` of forge_dist.kernels.forward_program): the shard's own state and
    # transition, folded from the segment summaries by the program.
    plan_summary = "folded"

    def plan_forward(self, kind: Kind, summaries: Dict[str, Tensor], S0: Optional[Tensor],
                     S_in: Tensor, group, word: int = 0,
                     keep: Optional[Dict[str, Any]] = None, zero_start: bool = False) -> Tensor:
        """A plan's forward state pass (no autograd): this rank's incoming state.

        ``summaries``: the program's workspaces after its summary launches, read on every
        rank but the last: ``delta [B, H, K, V]`` (the shard's state from a zero start) and,
        gated, ``cg [n_seg + 1, B, H, K]`` (row ``n_seg``: the shard's summed log decay).
        ``S0``: rank 0's start; zeros on the other ranks (and rank 0 without an initial
        state).  ``S_in``: a buffer this rank may fill with its incoming state (rank > 0);
        returns the incoming state (``S0`` on rank 0).  ``keep``: the plan's dict, as in
        :meth:`forward_chain`.  ``zero_start``: ``S0`` is zeros (a plan without an initial
        state), which a strategy may skip folding in.
        """
        out, _, _ = folded_forward_chain(self, kind, summaries, S0, group, word, keep)
        return out


def shard_transition(kind: Kind, summaries: Dict[str, Tensor], rank: int = 0
                     ) -> Optional[Tensor]:
    """A shard's transition from a plan program's folded summary: the delta rule's ``M``
    (rank 0 from zero: a zero one, runtime/sp_setup.py), else the exponential of the
    shard's summed log decay (``cg``'s last row, ``[B, H, K]``); ``None`` for the identity
    kind."""
    if kind is Kind.IDENTITY:
        return None
    if kind is Kind.DENSE:
        M = summaries.get("M", summaries.get("M_zero"))
        if M is None:
            raise ValueError(f"rank {rank}: a dense transition's chain needs the shard's M")
        return M
    total = summaries["cg"][-1]
    return (total[..., 0] if kind is Kind.SCALAR else total).exp()


def fold_segments(summaries: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A plan program's segment summaries (``summary="segments"``: ``hs [n_seg, B, H, K,
    V]`` and, gated, their log decays ``gt [n_seg, B, H, K]``) with their fold added as a
    folded summary has it: ``delta [B, H, K, V]`` (the shard's state from zero) and, gated,
    ``cg [n_seg + 1, B, H, K]`` (the log decay from the shard's start to each segment's
    start; the last row the shard's).  For the host's rounds; the device's fold them in
    their kernels."""
    hs, gt = summaries["hs"], summaries.get("gt")
    delta = hs[0].clone()
    for s in range(1, hs.shape[0]):
        delta = delta * gt[s, ..., None].exp() + hs[s] if gt is not None else delta + hs[s]
    out = dict(summaries, delta=delta)
    if gt is not None:
        out["cg"] = torch.cat([torch.zeros_like(gt[:1]), gt.cumsum(0)])
    return out


def folded_forward_chain(strategy: Strategy, kind: Kind, summaries: Dict[str, Tensor],
                         S0: Tensor, group, word: int = 0, keep: Optional[dict] = None
                         ) -> Tuple[Tensor, Optional[Tensor], Any]:
    """``strategy``'s forward chain on a plan program's folded summary (``summary="folded"``:
    ``delta`` and, gated, ``cg``; the delta rule's ``delta`` and ``M``): ``(S_in, M,
    saved)``, ``M`` this rank's shard transition
    (``None`` for the identity kind and on the last rank) and ``saved`` what
    :meth:`Strategy.backward_chain` takes; ``keep`` as in :meth:`Strategy.forward_chain`."""
    rank, size = p2p.rank_and_size(group)
    M = None
    if rank < size - 1:
        delta = summaries["delta"]
        M = shard_transition(kind, summaries, rank)
    else:  # the last rank: nobody reads its carry
        delta = S0
    S_in, saved = strategy.forward_chain(kind, M, delta, S0, group, word, keep)
    return S_in, M, saved


_REGISTRY: Dict[str, Strategy] = {}
AUTO_ORDER = ("forge", "lasp2", "serial")


def register(strategy: Strategy) -> Strategy:
    """Make ``strategy`` selectable by its name in every op's ``strategy=`` argument."""
    _REGISTRY[strategy.name] = strategy
    return strategy


def names() -> list[str]:
    """Registered strategy names plus ``"auto"``."""
    return sorted(_REGISTRY) + ["auto"]


def resolve(name: str, device: torch.device, group=None, *, kind: Optional[Kind] = None,
            state: Optional[Tuple[int, int, int, int]] = None) -> Strategy:
    """The strategy called ``name`` (``group``: the call's process group, read by ``auto``).

    ``"auto"``, for CUDA tensors where ``group`` is the whole job and NVSHMEM runs: the
    GPU-initiated pass that :func:`forge_dist.sp.choice.pick` predicts fastest for the
    group's layout by node (:func:`forge_dist.sp.layout.nodes`), the transition ``kind`` and
    the ``state`` shape ``(B, H, K, V)``.  At B=1, H=32, K=V=128 that is the chain
    (``forge``) on one node of 8 and on two nodes of 4, ``scan`` on one node of 16 (and at
    B=4 on one of 8), ``hier`` from 2 nodes of 8 (the dense transition: from 4 nodes); without
    ``kind`` and ``state`` (the DSL's path), ``forge`` where ``LOCAL_WORLD_SIZE`` equals
    ``WORLD_SIZE``.  On one
    node forge is the fastest strategy, or within noise of the fastest, in every measured
    2- and 4-GPU cell (docs/performance.md); across nodes the choice rests on the model's
    stated network parameters, not on a measurement.  Elsewhere ``lasp2`` (then
    ``serial``).  Not for a subgroup: forge's symmetric buffers are allocated by a
    collective over every process of the job, which the ranks outside the group (other
    data-parallel replicas, with other shapes, or pipeline stages) would not join.  Every
    rank resolves the same name (the agreed signature holds it, so a rank that resolved
    another fails with a clear error).
    """
    if not isinstance(name, str) or (name != "auto" and name not in _REGISTRY):
        raise ValueError(f"strategy: expected one of {names()}, got {name!r}")
    if name == "auto":
        for candidate in AUTO_ORDER:
            if candidate == "forge":
                forge = _REGISTRY.get("forge")
                if (forge is None or forge.available(device) is not None
                        or not _forge_for_auto(device, group)):
                    continue  # no GPU-initiated pass here (scan and hier would run host rounds)
                if kind is not None and state is not None:  # forge's transport runs: so do
                    # scan's and hier's rounds (their availability is forge's)
                    return _REGISTRY[layout.cached(
                        group, ("auto", kind, tuple(state)),
                        lambda nodes: choice.pick(nodes, kind, *state)[0])]
                else:
                    local = os.environ.get("LOCAL_WORLD_SIZE")
                    if local is None or local != os.environ.get("WORLD_SIZE"):
                        continue  # unpriced and maybe across nodes: the puts' network
            strat = _REGISTRY.get(candidate)
            if strat is not None and strat.available(device) is None:
                return strat
        raise RuntimeError("strategy='auto': no registered strategy can run here")
    strat = _REGISTRY[name]
    reason = strat.available(device)
    if reason is not None:
        raise ValueError(f"strategy={name!r} cannot run on {device}: {reason}")
    return strat


def _forge_for_auto(device, group) -> bool:
    """Whether ``auto`` may pick a GPU-initiated pass: CUDA tensors (on the CPU forge runs
    only the simulated transport, for tests) and a group that is the whole job."""
    if torch.device(device).type != "cuda" or group is None:
        return False
    return dist.is_initialized() and dist.get_world_size(group) == dist.get_world_size()


class _StatePass(torch.autograd.Function):
    """``S_in(r) = chain(M_0..M_{r-1}, dS_0..dS_{r-1}, S0)`` with the reverse chain as backward."""

    @staticmethod
    def forward(ctx, M, delta, S0, anchor, kind, strategy, group, word):
        S_in, saved = strategy.forward_chain(kind, M, delta, S0, group, word)
        if S_in is S0:  # rank 0: a Function must not hand an input back as its output
            S_in = S0.clone()
        ctx.kind, ctx.strategy, ctx.group, ctx.saved, ctx.word = kind, strategy, group, saved, word
        ctx.has_M = M is not None
        ctx.save_for_backward(M if M is not None else delta.new_empty(0), S_in)
        return S_in

    @staticmethod
    def backward(ctx, grad_in):
        M, S_in = ctx.saved_tensors
        M = M if ctx.has_M else None
        with phases.BACKWARD_CHAIN:
            lam_next, lam_here = ctx.strategy.backward_chain(ctx.kind, M, grad_in.contiguous(),
                                                             ctx.group, ctx.saved, ctx.word)
        grad_M = tr.transition_grad(ctx.kind, lam_next, S_in) if ctx.has_M else None
        return grad_M, lam_next, lam_here, None, None, None, None, None


def state_pass(kind: Kind, M: Optional[Tensor], delta: Tensor, S0: Tensor, group,
               strategy: Strategy, *, needs_grad: bool = False,
               anchor: Optional[Tensor] = None, word: int = 0) -> Tensor:
    """Differentiable inter-rank phase: this rank's incoming state ``S_in(r)``.

    Args:
        kind: transition kind of ``M``.
        M: this rank's shard transition (``None`` for identity, or on the last rank).
        delta: this rank's shard state from a zero start ``[B, H, K, V]``.
        S0: the state before the whole sequence (used on rank 0; zeros elsewhere).
        needs_grad: this op call will be differentiated.  Then the pass joins the backward
            graph on every rank, even one whose ``M``, ``delta`` and ``S0`` need no gradient
            (the last rank), because the reverse chain runs through all of them.
        anchor: a scalar computed from the op's inputs that need gradients; the pass hangs
            off it, so ``torch.autograd.grad(loss, inputs=...)`` (which runs only nodes on a
            path to the requested inputs) still runs this rank's reverse chain.  Its value is
            never read and it receives no gradient.  Without it, ``needs_grad`` makes a
            private leaf, which ``loss.backward()`` reaches but ``autograd.grad`` does not.
        word: the call's signature word (:func:`forge_dist.sp.agreement.agree`).
    """
    _, size = p2p.rank_and_size(group)
    if size == 1:
        return S0
    if anchor is None and needs_grad:
        anchor = torch.zeros((), device=delta.device, requires_grad=True)
    return _StatePass.apply(M, delta, S0, anchor, kind, strategy, group, word)

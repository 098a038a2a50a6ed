"""The contract between a variant's local (per-segment) math and the sequence-parallel runtime.

A *segment* is a contiguous run of tokens of one sequence that lives on one rank (a whole
shard, or the piece of a packed sequence inside it).  The local work of a segment splits into
what does not depend on the incoming state and what does, linearly:

    outputs     = o_zero + readout(S_in)[0]
    final state = delta + readout(S_in)[1]     (= M @ S_in + delta)

so a strategy can compute ``(M, delta)`` first, pass states between ranks, and merge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from torch import Tensor

from .transitions import Kind


@dataclass
class SegmentSummary:
    """Local results for one segment of ``L`` tokens (compute dtype: fp32, or fp64 for fp64 input).

    Attributes:
        o_zero: outputs as if the incoming state were zero; token axis at dim 1
            (``[B, L, H, V]``, HGRN ``[B, L, D]``).
        delta: the segment's final state from a zero incoming state, ``[B, H, K, V]``
            (HGRN ``[B, 1, D, 1]``).
        transition: ``M`` of the whole segment (shape by kind, see
            :mod:`~forge_dist.variants.transitions`); ``None`` when not asked for or identity.
        readout: ``S_in -> (contribution of S_in to the outputs, M @ S_in)``; linear in
            ``S_in`` and differentiable.  It carries the state without forming ``M``, so the
            last rank never pays for a dense transition chain.
    """

    o_zero: Tensor
    delta: Tensor
    transition: Optional[Tensor]
    readout: Callable[[Tensor], Tuple[Tensor, Tensor]]


# shapes of a variant's gate ``g`` (:attr:`VariantSpec.gate`)
GATE_SHAPES = {"head": "[B, T, H]", "channel": "[B, T, H, K]", "feature": "[B, T, D]"}


@dataclass(frozen=True)
class VariantSpec:
    """Static facts about a variant: its name, transition kind and state layout, and (for
    the registered ops, :mod:`.registry`) its kernels' pattern, its inputs and its gate.

    Attributes:
        pattern: the computational pattern whose kernels run it (``"scalar_decay"``,
            ``"vector_decay"``, ``"delta_rule"``, ``"vector_state"``; see
            :mod:`forge_dist.kernels`), or ``None`` (PyTorch only).
        inputs: the op's tensor inputs in call order (``("q", "k", "v", "g")``).
        gate: the shape of ``g`` (a key of :data:`GATE_SHAPES`), ``None`` without a gate.
        gate_optional: ``g`` may be left out (then the state does not decay).
    """

    name: str
    kind: Kind
    vector_state: bool = False  # True for HGRN (state [B, D], stored as [B, 1, D, 1])
    pattern: Optional[str] = None
    inputs: Tuple[str, ...] = ()
    gate: Optional[str] = None
    gate_optional: bool = False

    def input_names(self, gated: bool = True) -> Tuple[str, ...]:
        """:attr:`inputs`, without ``g`` when not ``gated``."""
        return tuple(n for n in self.inputs if gated or n != "g")

    def gate_text(self) -> str:
        """``g``'s shape as the docs write it (``"[B, T, H]"``)."""
        return GATE_SHAPES[self.gate]


class SegmentWork:
    """One segment's local work, as the runtime drives it (PyTorch or Triton backed).

    ``summary`` gives ``(delta, M)`` before any state arrives; ``finish`` gives the outputs
    and the final state once the incoming state is known.  Implementations compute lazily, so
    a single-rank call never pays for a summary it does not need.
    """

    def summary(self, need_transition: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """``(delta [B, H, K, V], M or None)`` of the segment."""
        raise NotImplementedError

    def finish(self, S_in: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """``(outputs, final state)`` given the incoming state (``None``: zeros)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Run now the work that does not need the incoming state (the runtime calls this
        before it waits for that state), so that ``finish`` has less left to do.  Default:
        nothing."""


class ChunkFormWork(SegmentWork):
    """:class:`SegmentWork` over a PyTorch chunk form returning a :class:`SegmentSummary`."""

    def __init__(self, summarize: Callable[[bool], SegmentSummary], need_transition: bool):
        self._summ = summarize(need_transition)

    def summary(self, need_transition: bool):
        return self._summ.delta, self._summ.transition

    def finish(self, S_in):
        if S_in is None:
            return self._summ.o_zero, self._summ.delta
        o_part, s_part = self._summ.readout(S_in)
        return self._summ.o_zero + o_part, self._summ.delta + s_part


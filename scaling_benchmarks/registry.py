"""One registry of the benchmarked ops and shapes, read by every benchmark.

An op's entry says what its call takes (argument names in the order of ``forge_dist.ops``)
and how its inputs are drawn: the gate's shape, whether keys are L2-normalised (the delta
rule needs it: unnormalised keys make ``I - beta k k^T`` expand and the state overflow) and
whether it takes ``beta``.  :func:`make_inputs` builds one input dict from an entry; a
benchmark passes its own random source, so each keeps the data it always measured on.

Shapes (``Shape``): the single-device protocol (B=1, H=32, K=V=128, hgrn on
``[1, T, 4096]``, T from 1K to 256K) and the weak-scaling shard (B=4, H=32, K=V=128, 32K
tokens per GPU; hgrn's width ``H * K`` unless set), as in ``docs/design.md`` section 10.

The ops are the package's registered variants (:mod:`forge_dist.variants.registry`): a new
op registered there is benchmarked with no change here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from forge_dist.variants import registry as variants


@dataclass(frozen=True)
class BenchOp:
    """How a benchmark calls one op and draws its inputs.

    ``args``: argument names in call order; ``gate``: ``"head"`` (``[B, T, H]``),
    ``"channel"`` (``[B, T, H, K]``), ``"feature"`` (hgrn: ``[B, T, D]``) or ``None``.
    """
    name: str
    args: Tuple[str, ...]
    gate: Optional[str]
    normalize_k: bool = False

    @property
    def vector_state(self) -> bool:
        return self.args[0] == "x"

    @property
    def first(self) -> str:
        """The activation that sets the output's shape and dtype (``q``, hgrn ``x``)."""
        return self.args[0]


def _bench_op(name: str) -> BenchOp:
    v = variants.get(name)
    # the delta rule's keys are drawn L2-normalised (unnormalised ones overflow its state)
    return BenchOp(name, v.inputs, v.gate, normalize_k=v.pattern == "delta_rule")


# every op the package registers with kernels (forge_dist.variants.registry)
OPS: Dict[str, BenchOp] = {name: _bench_op(name) for name in variants.names()
                           if variants.get(name).pattern is not None}
NAMES: Tuple[str, ...] = tuple(OPS)


@dataclass(frozen=True)
class Shape:
    """Batch, heads, head dims and hgrn's width (``D = 0``: ``H * K``)."""
    B: int
    H: int
    K: int
    V: int
    D: int = 0

    @property
    def hgrn_width(self) -> int:
        return self.D or self.H * self.K


SINGLE_DEVICE = Shape(B=1, H=32, K=128, V=128, D=4096)
SINGLE_DEVICE_T = (1024, 4096, 16384, 65536, 262144)
WEAK_SCALING = Shape(B=4, H=32, K=128, V=128)
WEAK_SCALING_TOKENS_PER_GPU = 32768


def spec(op: str) -> BenchOp:
    """The registry entry of ``op``; an unknown name raises naming the known ones."""
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"op: unknown benchmark op {op!r}; known: {', '.join(NAMES)}") from None


def make_inputs(op: str, shape: Shape, T: int, *, dtype: torch.dtype,
                randn: Callable[..., torch.Tensor], rand: Callable[..., torch.Tensor],
                gate_offset: float = 4.0, channel_gate_offset: float = 4.0,
                channel_gate_dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """One op's inputs by name: activations in ``dtype``, gates natural-log decays.

    ``randn(*shape)`` / ``rand(*shape)`` return fp32 tensors on the target device (the
    caller's generator decides the values); draws happen in the order q, k, v, g, beta
    (hgrn: x, g).  Gates are ``logsigmoid(randn + gate_offset)`` in fp32; hgrn's gate uses
    ``channel_gate_offset`` and ``channel_gate_dtype``.  Shapes: q, k ``[B, T, H, K]``,
    v ``[B, T, H, V]``, g ``[B, T, H]`` or ``[B, T, H, K]``, beta ``[B, T, H]``; hgrn x, g
    ``[B, T, D]``.
    """
    s = spec(op)
    B, H, K, V = shape.B, shape.H, shape.K, shape.V
    if s.vector_state:
        D = shape.hgrn_width
        x = randn(B, T, D).to(dtype)
        g = F.logsigmoid(randn(B, T, D) + channel_gate_offset).to(channel_gate_dtype)
        return {"x": x, "g": g}
    inp = {"q": randn(B, T, H, K).to(dtype), "k": randn(B, T, H, K).to(dtype),
           "v": randn(B, T, H, V).to(dtype)}
    if s.normalize_k:
        inp["k"] = F.normalize(inp["k"].float(), dim=-1).to(dtype)
    if s.gate == "head":
        inp["g"] = F.logsigmoid(randn(B, T, H) + gate_offset)
    elif s.gate == "channel":
        inp["g"] = F.logsigmoid(randn(B, T, H, K) + gate_offset)
    if "beta" in s.args:
        inp["beta"] = rand(B, T, H).to(dtype)
    return inp


def call_args(op: str, inp: Dict[str, torch.Tensor]):
    """The positional arguments of ``forge_dist.ops.<op>`` from an input dict."""
    return [inp[n] for n in spec(op).args]

"""Triton chunk kernels for the four computational patterns (DESIGN.md section 5).

==================  =========================  ===============================
pattern             variants                   module
==================  =========================  ===============================
scalar decay        linear_attn, simple_gla    :mod:`.scalar` (fused, decoupled)
vector decay        gla                        :mod:`.vector` (fused)
delta rule          gated_delta_rule, DeltaNet :mod:`.delta` (fused)
vector state        hgrn                       :mod:`.vector_state` (fused)
==================  =========================  ===============================

Entry points for the runtime::

    work = make_work(variant, inputs, scale, need_transition)   # None -> use PyTorch
    delta, M = work.summary(need_transition)
    o, final = work.finish(S_in)

``inputs`` holds the segment tensors by name (``q, k, v, g, beta``; hgrn ``x, g``).  The
work objects are differentiable, forward and backward in Triton (backward kernels:
:mod:`.scalar_backward`, :mod:`.vector_backward`, :mod:`.delta_backward`, and
:func:`.vector_state.hgrn_backward`; the summary's backward of the decay patterns is a closed
form, one kernel in :mod:`.summary_backward`, with :func:`._common.decay_summary_backward` as
its PyTorch reference).  :func:`forward` is a one-call convenience used by tests and
benchmarks.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ._common import HAVE_TRITON, interpreting

VARIANTS = ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn")
MAX_HEAD_DIM = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _work_class(variant: str):
    if variant in ("linear_attn", "simple_gla"):
        from .scalar import ScalarDecayWork
        return ScalarDecayWork
    if variant == "gla":
        from .vector import VectorDecayWork
        return VectorDecayWork
    if variant == "gated_delta_rule":
        from .delta import DeltaRuleWork
        return DeltaRuleWork
    if variant == "hgrn":
        from .vector_state import VectorStateWork
        return VectorStateWork
    return None


def supported(variant: str, inputs: Dict[str, Optional[torch.Tensor]]) -> Optional[str]:
    """``None`` if the Triton kernels handle this case, else the reason they do not."""
    if not HAVE_TRITON:
        return "triton is not installed"
    if variant not in VARIANTS:
        return f"unknown variant {variant!r}"
    names = ("x", "g") if variant == "hgrn" else ("q", "k", "v")
    tensors = {n: t for n, t in inputs.items() if t is not None}
    for n in names:
        if n not in tensors:
            return f"missing input {n!r}"
    first = tensors[names[0]]
    for n, t in tensors.items():
        if t.device != first.device:
            return f"{n} is on {t.device}, {names[0]} on {first.device}"
        if t.dtype not in _FLOATS and not (n in ("g", "beta") and t.dtype == torch.float64
                                            and first.dtype != torch.float64):
            return f"{n} has dtype {t.dtype} (kernels take fp16/bf16/fp32)"
    if first.device.type != "cuda" and not interpreting():
        return f"tensors on {first.device} (Triton needs CUDA, or TRITON_INTERPRET=1)"
    if first.shape[1] == 0:
        return "empty segment"
    if variant == "hgrn":
        if first.dim() != 3:
            return "hgrn expects x [B, T, D]"
        return None
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return "q, k, v dtypes differ"
    K, V = k.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM or K < 16 or V < 16:
        return f"head dims K={K}, V={V} outside [16, {MAX_HEAD_DIM}]"
    g = tensors.get("g")
    if variant == "linear_attn" and g is not None:
        return "linear_attn takes no gate"
    if variant == "simple_gla" and g is not None and g.dim() != 3:
        return "simple_gla expects g [B, T, H]"
    if variant == "gla" and (g is None or g.dim() != 4):
        return "gla expects g [B, T, H, K]"
    if variant == "gated_delta_rule":
        if tensors.get("beta") is None:
            return "gated_delta_rule needs beta"
        if g is not None and g.dim() != 3:
            return "gated_delta_rule expects g [B, T, H]"
    return None


# templates whose forward kernels apply fused input prologues, and the inputs they map
MAPPABLE = {"linear_attn": ("q", "k", "v"), "simple_gla": ("q", "k", "v", "g"),
            "gla": ("q", "k", "v", "g"), "hgrn": ("x", "g")}


def make_work(variant: str, inputs: Dict[str, Optional[torch.Tensor]], scale: Optional[float],
              need_transition: bool, *, out_dtype: Optional[torch.dtype] = None,
              execution: Optional[str] = None, maps: Optional[dict] = None):
    """A Triton-backed ``SegmentWork`` for one segment, or ``None`` (use the PyTorch path).

    Args:
        variant: one of :data:`VARIANTS`.
        inputs: segment tensors by name, token axis at dim 1.
        scale: query scale (``None``: ``K ** -0.5``; ignored by hgrn).
        need_transition: whether ``summary`` will be asked for ``M`` (informational: the
            work computes lazily either way).
        out_dtype: dtype of ``o`` from ``finish`` (default fp32, the compute dtype; pass the
            input dtype to save the fp32 write when the caller casts anyway).
        execution: ``"fused"`` / ``"decoupled"`` / ``None`` (scheduler, or the
            ``FORGE_DIST_EXECUTION`` environment variable).
        maps: fused elementwise prologues, input name -> :class:`._common.InputMap`: the
            kernels read the raw inputs and map every tile they load (inputs of
            :data:`MAPPABLE` only).
    """
    maps = {n: m for n, m in (maps or {}).items() if m is not None}
    extra = set(maps) - set(MAPPABLE.get(variant, ()))
    if extra:
        raise ValueError(f"make_work: maps: {variant} fuses prologues of "
                         f"{MAPPABLE.get(variant, ())} only, got {sorted(extra)}")
    if supported(variant, inputs) is not None:
        return None
    return _work_class(variant)(variant, dict(inputs), scale, need_transition,
                                out_dtype=out_dtype, execution=execution, maps=maps)


def forward(variant: str, inputs: Dict[str, Optional[torch.Tensor]], scale: Optional[float] = None,
            initial_state: Optional[torch.Tensor] = None, *, out_dtype=None, execution=None):
    """Single-segment forward: ``(o, final_state)`` (hgrn: ``final [B, D]``, state in ``[B, D]``).

    Raises ``ValueError`` with the reason when the case is unsupported.
    """
    reason = supported(variant, inputs)
    if reason is not None:
        raise ValueError(f"forge_dist.kernels: {variant}: {reason}")
    work = make_work(variant, inputs, scale, False, out_dtype=out_dtype, execution=execution)
    if variant == "hgrn":
        x = inputs["x"]
        S = None if initial_state is None else initial_state.reshape(x.shape[0], 1, x.shape[2], 1)
        o, ht = work.finish(S)
        return o, ht.reshape(x.shape[0], x.shape[2])
    return work.finish(initial_state)

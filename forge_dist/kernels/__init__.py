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

Entry points for plans and the AOT step: :func:`forward_program` and
:func:`backward_program`, the launches of one call as a :class:`.ir.Program`, built by the
pattern modules (the eager functions launch the same records, :mod:`.walker_launches`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ._common import HAVE_TRITON, interpreting

MATRIX_VARIANTS = ("linear_attn", "simple_gla", "gla", "gated_delta_rule")
VARIANTS = MATRIX_VARIANTS + ("hgrn",)
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


def _precision(interp: bool) -> str:
    # the kernels' rule (_common.dot_precision): IEEE under the interpreter, else 3xTF32
    return "ieee" if interp else "tf32x3"


def forward_program(variant: str, *, B: int, T: int, dtype: torch.dtype, has_h0: bool,
                    H: Optional[int] = None, K: Optional[int] = None, V: Optional[int] = None,
                    D: Optional[int] = None, gated: Optional[bool] = None,
                    store_o: bool = True, scale: Optional[float] = None,
                    execution: Optional[str] = None, interp: bool = False,
                    tiles: Optional[dict] = None, gate_dtype: Optional[torch.dtype] = None,
                    beta_dtype: Optional[torch.dtype] = None, maps: Optional[dict] = None):
    """Program of one segment forward (or, ``store_o=False``, its summary) of ``variant``,
    built by its pattern module's ``forward_program``.

    Matrix state: inputs ``q, k`` (``dtype``, ``[B, T, H, K]``), ``v`` (``[B, T, H, V]``),
    ``g`` (``gate_dtype``, default fp32; by the variant's gate shape), ``beta``
    (gated_delta_rule, ``beta_dtype``, default ``gate_dtype``), ``h0`` (fp32 ``[B, H, K,
    V]``); outputs ``o`` (``dtype``) and ``ht`` (fp32); workspaces by pattern.  hgrn:
    ``x, g [B, T, D]`` (``gate_dtype`` default ``dtype``), ``h0, ht [B, D]``.
    ``execution`` forces fused or decoupled; ``None`` asks the scheduler, as the kernels
    do.  ``interp``: the interpreter's precision rule.  ``tiles`` overrides entries of the
    pattern's tile config.  ``maps``: fused prologues by input name (jitted maps of
    :mod:`forge_dist.dsl.codegen`), applied as the kernels load.
    """
    if variant == "hgrn":
        from . import vector_state

        return vector_state.forward_program(B=B, T=T, D=D, dtype=dtype, has_h0=has_h0,
                                            store_o=store_o, tiles=tiles,
                                            gate_dtype=gate_dtype, execution=execution,
                                            maps=maps)
    if variant not in MATRIX_VARIANTS:
        raise ValueError(f"variant: expected one of {MATRIX_VARIANTS}, got {variant!r}")
    if variant == "linear_attn" and gated:
        raise ValueError("linear_attn takes no gate")
    if variant == "gla" and not gated:
        raise ValueError("gla needs its gate g [B, T, H, K]")
    kw = dict(B=B, T=T, H=H, K=K, V=V, dtype=dtype, gated=bool(gated), has_h0=has_h0,
              store_o=store_o, scale=K ** -0.5 if scale is None else float(scale),
              prec=_precision(interp), execution=execution, tiles=tiles,
              gate_dtype=gate_dtype or torch.float32, maps=maps)
    if variant == "gated_delta_rule":
        from . import delta

        return delta.forward_program(beta_dtype=beta_dtype, **kw)
    if variant == "gla":
        from . import vector

        return vector.forward_program(**kw)
    from . import scalar

    return scalar.forward_program(**kw)


def backward_program(variant: str, *, B: int, T: int, dtype: torch.dtype, has_h0: bool,
                     has_dht: bool, H: Optional[int] = None, K: Optional[int] = None,
                     V: Optional[int] = None, D: Optional[int] = None,
                     gated: Optional[bool] = None, scale: Optional[float] = None,
                     interp: bool = False, beta_dtype: torch.dtype = torch.float32,
                     gate_dtype: Optional[torch.dtype] = None,
                     execution: Optional[str] = None, sms: int = 132):
    """Program of one backward on one device, built by the pattern's backward module
    (``scalar_backward``, ``vector_backward``, ``delta_backward``, ``vector_state``) with
    the plans' precision rule and ``sms`` (the device's SM count, which sizes the walk
    tiles).

    Matrix state: inputs ``q, k, v, do`` and, by variant, ``g`` (fp32), ``beta``
    (``beta_dtype``), ``h0``, ``dht``; outputs ``dq, dk, dv``, ``dg`` (gla,
    gated_delta_rule) or ``dg_part`` (``[NK, B, T, H]``, simple_gla: the K tiles' shares),
    ``dbeta`` (gated_delta_rule), ``dh0`` (``has_h0``); the rest per-call scratch.  hgrn:
    from the forward's kept outputs (``g, do, h``; ``gate_dtype``, ``execution``).
    """
    if variant == "hgrn":
        from . import vector_state

        return vector_state.backward_program(B=B, T=T, D=D, dtype=dtype, has_h0=has_h0,
                                             has_dht=has_dht, gate_dtype=gate_dtype,
                                             execution=execution)
    if variant not in MATRIX_VARIANTS:
        raise ValueError(f"variant: expected one of {MATRIX_VARIANTS}, got {variant!r}")
    common = dict(dtype=dtype, has_h0=has_h0, has_dht=has_dht,
                  scale=K ** -0.5 if scale is None else float(scale), prec=_precision(interp))
    if variant in ("linear_attn", "simple_gla"):
        from . import scalar_backward

        return scalar_backward.backward_program(B, T, H, K, V, gated=bool(gated), sms=sms,
                                                **common)
    if variant == "gla":
        from . import vector_backward

        return vector_backward.backward_program(B, T, H, K, V, sms=sms, **common)
    from . import delta_backward

    return delta_backward.backward_program(B, T, H, K, V, gated=bool(gated),
                                           beta_dtype=beta_dtype, **common)

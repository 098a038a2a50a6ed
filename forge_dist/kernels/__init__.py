"""Triton chunk kernels for the four computational patterns (docs/design.md section 5).

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
form, one kernel in :mod:`.summary_backward`, with
:func:`.summary_backward.decay_summary_backward` as its PyTorch reference).  :func:`forward`
is a one-call convenience used by tests and benchmarks.

Entry points for plans and the AOT step: :func:`forward_program` and
:func:`backward_program`, the launches of one call as a :class:`.ir.Program`, built by the
pattern modules (the eager functions launch the same records, :mod:`.walker_launches`).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..variants import registry
from .compat import HAVE_TRITON, interpreting
from .ir import Program

MAX_HEAD_DIM = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Pattern:
    """Where a computational pattern's kernels live (modules of this package)."""

    module: str  # its work class and forward_program
    work: str  # the work class's name
    backward_module: str  # its backward_program
    mappable: Tuple[str, ...]  # inputs its forward kernels map with fused prologues
    backward_takes: Tuple[str, ...] = ()  # optional arguments of its backward_program
    # the backward launches that give the incoming state's gradient alone (the last one the
    # reverse state walk, which takes STORE_STATES): state_grad_program
    state_grad: Tuple[str, ...] = ()


# the patterns of :attr:`forge_dist.variants.base.VariantSpec.pattern`
PATTERNS = {
    "scalar_decay": Pattern("scalar", "ScalarDecayWork", "scalar_backward",
                            ("q", "k", "v", "g"), ("gated", "sms"), ("chunk_states_bwd",)),
    "vector_decay": Pattern("vector", "VectorDecayWork", "vector_backward",
                            ("q", "k", "v", "g"), ("sms",), ("chunk_states_bwd",)),
    "delta_rule": Pattern("delta", "DeltaRuleWork", "delta_backward", (),
                          ("gated", "beta_dtype"), ("wy", "delta_dstates")),
    "vector_state": Pattern("vector_state", "VectorStateWork", "vector_state", ("x", "g")),
}


def _spec(variant: str):
    """The registered spec of ``variant`` if its pattern has kernels here, else ``None``."""
    spec = registry.find(variant)
    return spec if spec is not None and spec.pattern in PATTERNS else None


def variants() -> tuple:
    """The registered variants that have Triton kernels."""
    return tuple(n for n in registry.names() if _spec(n) is not None)


def matrix_variants() -> tuple:
    """:func:`variants` with a matrix state ``[B, H, K, V]``."""
    return tuple(n for n in variants() if not registry.get(n).vector_state)


def sm_count(device) -> int:
    """SMs of ``device`` (an int passes through: a count a caller already has)."""
    if isinstance(device, int):
        return device
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # nominal (H100/H200) for CPU runs under the interpreter


def summed_gate_grad(dg_part: torch.Tensor) -> torch.Tensor:
    """``dg [B, T, H]`` from a backward program's ``dg_part [NK, B, T, H]``, the K tiles'
    shares (a view when there is one tile)."""
    return dg_part[0] if dg_part.shape[0] == 1 else dg_part.sum(0)


def summary_precision() -> str:
    """``FORGE_DIST_DENSE_SUMMARY``: ``input`` (default) computes a 16-bit shard's summary
    (delta and the dense M) with the forward's own operands and shares the forward's WY
    factors; ``fp32`` computes it from fp32 copies with 3xTF32 dots (about 5x slower at the
    weak-scaling shard, ``results/gdn_pieces_*.json``: relative error of ``M S + delta``
    2e-7 instead of 2.7e-3, which is the bf16 forward's own level)."""
    raw = os.environ.get("FORGE_DIST_DENSE_SUMMARY", "").strip().lower() or "input"
    if raw not in ("input", "fp32"):
        raise ValueError(f"FORGE_DIST_DENSE_SUMMARY: expected 'input' or 'fp32', got {raw!r}")
    return raw


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


_WORK_CLASSES: dict = {}  # variant -> its work class (looked up per eager call)


def _work_class(variant: str):
    cls = _WORK_CLASSES.get(variant)
    if cls is None:
        spec = _spec(variant)
        if spec is None:
            return None
        pattern = PATTERNS[spec.pattern]
        cls = _WORK_CLASSES[variant] = getattr(_module(pattern.module), pattern.work)
    return cls


def mappable(variant: str) -> tuple:
    """The inputs of ``variant`` whose fused prologues its forward kernels apply."""
    spec = _spec(variant)
    if spec is None:
        return ()
    return tuple(n for n in PATTERNS[spec.pattern].mappable if n in spec.inputs)


def supported(variant: str, inputs: Dict[str, Optional[torch.Tensor]]) -> Optional[str]:
    """``None`` if the Triton kernels handle this case, else the reason they do not."""
    if not HAVE_TRITON:
        return "triton is not installed"
    spec = _spec(variant)
    if spec is None:
        return f"unknown variant {variant!r}"
    # the inputs no call can leave out: the state update's own (x, or q, k, v)
    names = spec.inputs[:2] if spec.vector_state else spec.inputs[:3]
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
    if spec.vector_state:
        if first.dim() != 3:
            return f"{variant} expects {names[0]} [B, T, D]"
        return None
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return "q, k, v dtypes differ"
    K, V = k.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM or K < 16 or V < 16:
        return f"head dims K={K}, V={V} outside [16, {MAX_HEAD_DIM}]"
    for n in spec.inputs[4:]:  # inputs past the gate (the delta rule's beta)
        if tensors.get(n) is None:
            return f"{variant} needs {n}"
    g = tensors.get("g")
    if spec.gate is None:
        if g is not None:
            return f"{variant} takes no gate"
    elif (g is not None or not spec.gate_optional) and (
            g is None or g.dim() != spec.gate_text().count(",") + 1):
        return f"{variant} expects g {spec.gate_text()}"
    return None


# variant name -> the inputs its kernels map with fused prologues (:func:`mappable`)
MAPPABLE = {n: mappable(n) for n in variants() if mappable(n)}


def make_work(variant: str, inputs: Dict[str, Optional[torch.Tensor]], scale: Optional[float],
              need_transition: bool, *, out_dtype: Optional[torch.dtype] = None,
              execution: Optional[str] = None, maps: Optional[dict] = None):
    """A Triton-backed ``SegmentWork`` for one segment, or ``None`` (use the PyTorch path).

    Args:
        variant: one of :func:`variants`.
        inputs: segment tensors by name, token axis at dim 1.
        scale: query scale (``None``: ``K ** -0.5``; ignored by hgrn).
        need_transition: whether ``summary`` will be asked for ``M`` (informational: the
            work computes lazily either way).
        out_dtype: dtype of ``o`` from ``finish`` (default fp32, the compute dtype; pass the
            input dtype to save the fp32 write when the caller casts anyway).
        execution: ``"fused"`` / ``"decoupled"`` / ``None`` (scheduler, or the
            ``FORGE_DIST_EXECUTION`` environment variable).
        maps: fused elementwise prologues, input name -> :class:`.work.InputMap`: the
            kernels read the raw inputs and map every tile they load (inputs of
            :func:`mappable` only).
    """
    maps = {n: m for n, m in maps.items() if m is not None} if maps else {}
    extra = set(maps) - set(mappable(variant)) if maps else ()
    if extra:
        raise ValueError(f"make_work: maps: {variant} fuses prologues of "
                         f"{mappable(variant)} only, got {sorted(extra)}")
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
    if registry.get(variant).vector_state:
        x = inputs["x"]
        S = None if initial_state is None else initial_state.reshape(x.shape[0], 1, x.shape[2], 1)
        o, ht = work.finish(S)
        return o, ht.reshape(x.shape[0], x.shape[2])
    return work.finish(initial_state)


def _precision(interp: bool) -> str:
    # the kernels' rule (compat.dot_precision): IEEE under the interpreter, else 3xTF32
    return "ieee" if interp else "tf32x3"


def forward_program(variant: str, *, B: int, T: int, dtype: torch.dtype, has_h0: bool,
                    H: Optional[int] = None, K: Optional[int] = None, V: Optional[int] = None,
                    D: Optional[int] = None, gated: Optional[bool] = None,
                    store_o: bool = True, scale: Optional[float] = None,
                    execution: Optional[str] = None, interp: bool = False,
                    tiles: Optional[dict] = None, gate_dtype: Optional[torch.dtype] = None,
                    beta_dtype: Optional[torch.dtype] = None, maps: Optional[dict] = None,
                    summary: str = "none"):
    """Program of one segment forward (or, ``store_o=False``, its summary) of ``variant``,
    built by its pattern module's ``forward_program``.

    ``summary`` (:func:`sp_summary_variants`): ``"none"``, ``"segments"``
    or ``"folded"`` (the delta rule: ``"state"`` or ``"folded"``; hgrn: ``"folded"``, or
    ``"incoming"`` on the last rank), what a sequence-parallel
    rank keeps besides its outputs (:func:`.walker_launches.walk_launches`,
    :func:`.delta.forward_program`, :func:`.vector_state.forward_program`): the program's
    last launch is then the output walks, and the state pass goes before it.

    Matrix state: inputs ``q, k`` (``dtype``, ``[B, T, H, K]``), ``v`` (``[B, T, H, V]``),
    ``g`` (``gate_dtype``, default fp32; by the variant's gate shape), ``beta``
    (the delta rule, ``beta_dtype``, default ``gate_dtype``), ``h0`` (fp32 ``[B, H, K,
    V]``); outputs ``o`` (``dtype``) and ``ht`` (fp32); workspaces by pattern.  hgrn:
    ``x, g [B, T, D]`` (``gate_dtype`` default ``dtype``), ``h0, ht [B, D]``.
    ``execution`` forces fused or decoupled; ``None`` asks the scheduler, as the kernels
    do.  ``interp``: the interpreter's precision rule.  ``tiles`` overrides entries of the
    pattern's tile config.  ``maps``: fused prologues by input name (jitted maps of
    :mod:`forge_dist.dsl.codegen`), applied as the kernels load.
    """
    spec = _spec(variant)
    if spec is None:
        raise ValueError(f"variant: expected one of {variants()}, got {variant!r}")
    module = _module(PATTERNS[spec.pattern].module)
    if spec.vector_state:
        return module.forward_program(B=B, T=T, D=D, dtype=dtype, has_h0=has_h0,
                                      store_o=store_o, tiles=tiles, gate_dtype=gate_dtype,
                                      execution=execution, maps=maps, summary=summary)
    if summary != "none" and variant not in sp_summary_variants():
        raise ValueError(f"summary={summary!r}: {variant} has no sequence-parallel summary "
                         f"program (those of {sp_summary_variants()} only)")
    if spec.gate is None and gated:
        raise ValueError(f"{variant} takes no gate")
    if spec.gate is not None and not spec.gate_optional and not gated:
        raise ValueError(f"{variant} needs its gate g {spec.gate_text()}")
    kw = dict(B=B, T=T, H=H, K=K, V=V, dtype=dtype, gated=bool(gated), has_h0=has_h0,
              store_o=store_o, scale=K ** -0.5 if scale is None else float(scale),
              prec=_precision(interp), execution=execution, tiles=tiles,
              gate_dtype=gate_dtype or torch.float32, maps=maps)
    if "beta" in spec.inputs:
        kw["beta_dtype"] = beta_dtype
    if summary != "none":
        kw["summary"] = summary
    return module.forward_program(**kw)


def sp_summary_variants() -> tuple:
    """The variants whose forward programs keep a sequence-parallel summary (``summary=``):
    every one (the delta rule's dense transition from a walk of its own,
    :func:`.delta.forward_program`; hgrn's from its segment scan,
    :func:`.vector_state.forward_program`)."""
    return variants()


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
    the delta rule) or ``dg_part`` (``[NK, B, T, H]``, simple_gla: the K tiles' shares),
    ``dbeta`` (the delta rule), ``dh0`` (``has_h0``); the rest per-call scratch.  hgrn:
    from the forward's kept outputs (``g, do, h``; ``gate_dtype``, ``execution``).
    """
    spec = _spec(variant)
    if spec is None:
        raise ValueError(f"variant: expected one of {variants()}, got {variant!r}")
    pattern = PATTERNS[spec.pattern]
    module = _module(pattern.backward_module)
    if spec.vector_state:
        return module.backward_program(B=B, T=T, D=D, dtype=dtype, has_h0=has_h0,
                                       has_dht=has_dht, gate_dtype=gate_dtype,
                                       execution=execution)
    optional = dict(gated=bool(gated), sms=sms, beta_dtype=beta_dtype)
    return module.backward_program(
        B, T, H, K, V, dtype=dtype, has_h0=has_h0, has_dht=has_dht,
        scale=K ** -0.5 if scale is None else float(scale), prec=_precision(interp),
        **{n: optional[n] for n in pattern.backward_takes})


def state_grad_program(variant: str, *, B: int, T: int, H: Optional[int] = None,
                       K: Optional[int] = None, V: Optional[int] = None,
                       dtype: torch.dtype, has_dht: bool, gated: Optional[bool] = None,
                       scale: Optional[float] = None, interp: bool = False, sms: int = 132,
                       beta_dtype: torch.dtype = torch.float32, D: Optional[int] = None,
                       n_seg: Optional[int] = None):
    """Program of the gradient of a shard's incoming state through its own outputs (and
    ``dht``, the gradient of its final state): the reverse state walk of
    :func:`backward_program` (after the delta rule's WY factors), storing ``dh0
    [B, H, K, V]`` fp32 and no chunk states.

    A sequence-parallel rank runs it before its backward, so that the reverse chain of
    state gradients can leave the rank while its backward waits only for the next rank's
    gradient (``forge_dist/runtime/sp_train.py``, ``forge_dist/ops/runner.py``).  Inputs
    as the backward program's, less those the walk does not read (the scalar and vector
    patterns: ``q, do``, gated ``g``; the delta rule: also ``k, v, beta``), ``dht`` with
    ``has_dht``.  hgrn (``D``, ``n_seg``: its backward's segments): the reverse scan over
    copies of the segments' gradients (:func:`.vector_state.state_grad_program`).
    """
    spec = _spec(variant)
    if spec is None:
        raise ValueError(f"state_grad_program: expected one of {variants()}, got {variant!r}")
    if spec.vector_state:
        return _module(PATTERNS[spec.pattern].backward_module).state_grad_program(
            B=B, D=D, n_seg=n_seg, has_dht=has_dht)
    if gated is None:
        gated = spec.gate is not None
    full = backward_program(variant, B=B, T=T, H=H, K=K, V=V, dtype=dtype, has_h0=True,
                            has_dht=has_dht, gated=gated, scale=scale, interp=interp, sms=sms,
                            beta_dtype=beta_dtype)
    *before, walk_name = PATTERNS[spec.pattern].state_grad
    launches = [ln for ln in full.launches if ln.kernel in before]
    walk = next(ln for ln in full.launches if ln.kernel == walk_name)
    # the walk's chunk states are never written (STORE_STATES=False) and an absent input's
    # placeholder never read: point those arguments at dh0, so they need no buffer
    made = {v for ln in launches for _, kind, v in ln.args if kind == "buf"}
    scratch = {n for n, b in full.buffers.items() if b.role == "scratch" and n not in made}
    args = tuple((n, kind, "dh0" if kind == "buf" and value in scratch else value)
                 for n, kind, value in walk.args)
    launches.append(dataclasses.replace(walk, args=args,
                                        constexprs=walk.constexprs + (("STORE_STATES", False),)))
    used = {value for ln in launches for _, kind, value in ln.args if kind == "buf"}
    return Program(launches, {n: b for n, b in full.buffers.items() if n in used}, "backward",
                   ["state gradient: one reverse walk, dh0 only"])

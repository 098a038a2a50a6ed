"""The user API: ``variant(name, chunk_mode=..., decay_mode=..., merge_mode=...)``.

A variant is three PyTorch callables on *chunk tensors*.  Every per-token input of the op
(``[B, T, H, D]``; per-head scalars ``[B, T, H]``) reaches them cut into chunks of ``C``
tokens, ``[B, H, NT, C, D]`` (scalars ``[B, H, NT, C]``); with ``state="vector"`` inputs are
``[B, T, D]`` and chunks ``[B, NT, C, D]``.  The phases' parameters are bound to the inputs
*by name* (any names: lowering onto a template matches inputs by role, :mod:`.roles`):

``chunk_mode(<inputs>, [scale]) -> chunk_state``
    each chunk's state contribution from a zero start, ``[B, H, NT, K, V]`` (vector:
    ``[B, NT, D]``).  ``dsl.cache("u", u)`` keeps an intermediate for the later phases.
``decay_mode(state, [chunk_state], <inputs / cached>) -> next state``
    the state after a chunk given the state at its start (same shape); must be affine in
    ``state``.  Its linear part is the chunk transition: identity / scalar / diagonal / dense.
``merge_mode(state, <inputs / cached>, [scale]) -> o``
    the chunk's outputs given its start state, ``[B, H, NT, C, V]`` (vector ``[B, NT, C, D]``);
    affine in ``state``.

Write shape-generic code: index from the end (``x[..., -1:, :]``), get sizes from tensors
(``C = k.shape[-2]``) and build masks with ``x.new_ones(C, C)`` or the helpers in
:mod:`forge_dist.dsl.helpers`: the graphs are traced once with symbolic sizes and reused for
every chunk length (a ragged final chunk runs with its own length).
"""
from __future__ import annotations

import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..ops import checks
from ..ops.runner import needs_grad, run
from .. import sp
from ..sp import p2p
from ..variants.base import ChunkFormWork, VariantSpec
from ..variants.transitions import Kind
from . import analysis, executor, generated, lowering
from .trace import (MATRIX_DIMS, VECTOR_DIMS, DSLError, ShapeContext, propagate,
                    shape_text, trace_phase)
from .validate import check_numerically

RESERVED = ("state", "chunk_state", "scale")
COMBINE = {Kind.IDENTITY: "add (K*V per head)", Kind.SCALAR: "scale + add (K*V per head)",
           Kind.DIAGONAL: "row scale + add (K*V per head)",
           Kind.DENSE: "K x K matmul + add (K*K*V per head)"}


def _default_dims(name: str, vector: bool) -> str:
    if vector:
        return "D"
    return {"q": "K", "k": "K", "v": "V"}.get(name, "")


class Variant:
    """A compiled variant: ``.kind``, ``.describe()``, and callable as an op (see ``__call__``)."""

    def __init__(self, name: str, chunk_mode: Callable, decay_mode: Callable,
                 merge_mode: Callable, *, state: str = "matrix",
                 inputs: Optional[Union[Sequence[str], Dict[str, str]]] = None,
                 chunk_size: Optional[int] = None, lower: bool = True,
                 fuse_prologues: bool = False):
        if state not in ("matrix", "vector"):
            raise DSLError(f"state: expected 'matrix' or 'vector', got {state!r}")
        self.name = name
        self.vector = state == "vector"
        self.chunk = trace_phase(chunk_mode, "chunk_mode")
        self.decay = trace_phase(decay_mode, "decay_mode")
        self.merge = trace_phase(merge_mode, "merge_mode")
        self.inputs = self._input_dims(inputs)
        self.input_names = list(self.inputs)
        self.chunk_size = int(chunk_size or 32)
        self._check_and_classify()
        self.spec = VariantSpec(name, self.kind, vector_state=self.vector)
        self.fingerprint = zlib.crc32("|".join(
            [name, state, self.kind.value] + [str(p.gm.code) for p in
                                              (self.chunk, self.decay, self.merge)]).encode()) % (2 ** 31)
        self._compiled = None  # the generated path's graphs, compiled at the first CUDA call
        self.lowering = None
        self.lowering_reason = "not attempted (lower=False)"
        self.lowering_hint = "pass lower=True"
        if lower:
            decision = lowering.lower(self, fuse=fuse_prologues)
            self.lowering = decision.lowering
            self.lowering_reason, self.lowering_hint = decision.reason, decision.hint

    # -- compile ------------------------------------------------------------------------------
    def _input_dims(self, inputs) -> Dict[str, str]:
        cached = set(self.chunk.cached)
        if inputs is None:
            names: List[str] = []
            for ph in (self.chunk, self.merge, self.decay):
                for p in ph.params:
                    if p not in RESERVED and p not in cached and p not in names:
                        names.append(p)
            inputs = names
        if not isinstance(inputs, dict):
            inputs = {n: _default_dims(n, self.vector) for n in inputs}
        allowed = {"D", ""} if self.vector else {"K", "V", ""}
        for n, d in inputs.items():
            if n in RESERVED or n in cached:
                raise DSLError(f"inputs: {n!r} is reserved (state / chunk_state / scale / "
                               f"a cached name)")
            if d not in allowed:
                raise DSLError(f"inputs: {n!r} has trailing dims {d!r}; expected one of "
                               f"{sorted(allowed)}")
        if not inputs:
            raise DSLError("the variant has no inputs")
        if not self.vector and "V" not in inputs.values():
            raise DSLError("a matrix-state variant needs an input with trailing dim 'V' "
                           "(declare inputs={'v': 'V', ...})")
        return dict(inputs)

    def chunk_dims(self, name: str) -> Tuple[str, ...]:
        lead = ("B", "NT", "C") if self.vector else ("B", "H", "NT", "C")
        d = self.inputs[name]
        return lead + ((d,) if d else ())

    @property
    def state_dims(self) -> Tuple[str, ...]:
        return ("B", "NT", "D") if self.vector else ("B", "H", "NT", "K", "V")

    @property
    def output_dims(self) -> Tuple[str, ...]:
        return ("B", "NT", "C", "D") if self.vector else ("B", "H", "NT", "C", "V")

    def _check_and_classify(self):
        ctx = ShapeContext(VECTOR_DIMS if self.vector else MATRIX_DIMS)
        fake = {n: ctx.fake(self.chunk_dims(n)) for n in self.input_names}
        fake["scale"] = 0.5
        for ph in (self.chunk, self.decay, self.merge):
            for p in ph.params:
                if p == "chunk_state" and ph is self.chunk:
                    raise DSLError("chunk_mode: 'chunk_state' is what chunk_mode returns; "
                                   "it cannot be a parameter")
        out = propagate(self.chunk, ctx, fake)
        out = out if isinstance(out, tuple) else (out,)
        res = next(n for n in self.chunk.gm.graph.nodes if n.op == "output").args[0]
        res = res[0] if isinstance(res, tuple) else res
        got = self.chunk.node_shape(res)
        if got != self.state_dims:
            raise DSLError(f"chunk_mode: returns shape {shape_text(got)}; expected the "
                           f"per-chunk state {shape_text(self.state_dims)}")
        fake.update(zip(self.chunk.cached, out[1:]))
        fake["chunk_state"] = out[0]
        fake["state"] = ctx.fake(self.state_dims)
        propagate(self.decay, ctx, fake)
        propagate(self.merge, ctx, fake)
        dec = analysis.analyse(self.decay, track_kind=True, vector=self.vector,
                               expect=self.state_dims)
        mer = analysis.analyse(self.merge, track_kind=False, vector=self.vector,
                               expect=self.output_dims)
        self.kind: Kind = dec.kind
        self.decay_linear = dec.linear
        # decay_mode(0) is this argument as it comes (``... + chunk_state``), or None
        self.decay_offset = analysis.offset_parameter(self.decay, dec.dependent)
        self.merge_linear = mer.linear
        # merge_mode at a zero chunk-start state (the intra-chunk outputs), or None
        self.merge_offset = analysis.offset_part(self.merge, mer.dependent)
        check_numerically(self)

    # -- info ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """Human-readable summary: state, kind, combine, inputs, caches, lowering."""
        lines = [f"variant {self.name!r}",
                 f"  state:      {'vector [B, D]' if self.vector else 'matrix [B, H, K, V]'}",
                 f"  transition: {self.kind.value} (cross-rank combine: {COMBINE[self.kind]})",
                 "  inputs:     " + ", ".join(
                     f"{n} {shape_text(('B', 'T') + (() if self.vector else ('H',)) + ((d,) if d else ()))}"
                     for n, d in self.inputs.items()),
                 f"  cached:     {', '.join(self.chunk.cached) or '-'}",
                 f"  chunk size: {self.chunk_size}",
                 "  execution:  " + generated.describe(self)]
        return "\n".join(lines)

    def __repr__(self):
        return f"<forge_dist.dsl variant {self.name!r}: {'vector' if self.vector else 'matrix'} " \
               f"state, {self.kind.value} transition>"

    # -- the op -------------------------------------------------------------------------------
    def summarize(self, part: Dict[str, Tensor], scale: float, need_transition: bool,
                  chunk_size: Optional[int] = None, graphs=None):
        """Executor path for one segment (see :mod:`forge_dist.dsl.executor`); ``graphs``:
        the compiled graphs of the generated path (default the traced ones)."""
        return executor.summarize(self, part, scale, need_transition, chunk_size, graphs)

    def path(self, device: torch.device) -> str:
        """``"template"``, ``"generated"`` or ``"executor"``: how a call on ``device`` runs
        (:func:`forge_dist.dsl.generated.path_for`)."""
        return generated.path_for(self, device)

    def _generated_graphs(self):
        if self._compiled is None:
            self._compiled = generated.compiled_graphs(self)
        return self._compiled

    def __call__(self, *tensors: Tensor, scale: Optional[float] = None,
                 initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                 cu_seqlens: Optional[Tensor] = None, group=None, strategy: str = "auto",
                 chunk_size: Optional[int] = None, **named: Tensor):
        """Run the variant (FLA conventions, optional sequence parallelism).

        Args:
            tensors: the inputs in declaration order (``.input_names``), or by name:
                ``[B, T, H, D]`` per the declared trailing dim (``K`` / ``V``), ``[B, T, H]``
                for per-head scalars; vector state: ``[B, T, D]`` / ``[B, T]``.
            scale: value of the ``scale`` parameter (default ``K ** -0.5``; vector: 1).
            initial_state: ``[B, H, K, V]`` (vector ``[B, D]``; ``[N, ...]`` with cu_seqlens).
            cu_seqlens, group, strategy: as :func:`forge_dist.ops.linear_attn`.
        Returns:
            ``(o [B, T, H, V] (vector [B, T, D]), final_state or None)``.
        """
        inputs = self._bind(tensors, named)
        first = inputs[self.input_names[0]]
        checks.tensor(self.input_names[0], first, [None] * (first.dim() if isinstance(first, Tensor) else 3))
        B, T = first.shape[:2]
        H = 1 if self.vector else first.shape[2]
        sizes: Dict[str, int] = {}
        for n in self.input_names:
            d = self.inputs[n]
            t = inputs[n]
            lead = [B, T] if self.vector else [B, T, H]
            want = lead + ([sizes.get(d)] if d else [])
            checks.tensor(n, t, want)
            if d:
                sizes.setdefault(d, t.shape[-1])
        device = checks.same_device({**inputs, "initial_state": initial_state})
        main = {n: inputs[n] for n in self.input_names if self.inputs[n]}
        dtype = checks.same_dtype(main or {self.input_names[0]: first})
        if self.vector:
            D = sizes.get("D")
            if D is None:
                raise DSLError(f"{self.name}: no input carries the D dimension")
            K, V, state_rows = D, 1, (D,)
            scale_v = 1.0 if scale is None else checks.scale(scale, D)
        else:
            K, V = sizes.get("K"), sizes["V"]
            if K is None:
                raise DSLError(f"{self.name}: no input carries the K dimension")
            state_rows = (H, K, V)
            scale_v = checks.scale(scale, K)
        checks.strategy(strategy)
        path, why = self.path(device), ""
        if path == generated.TEMPLATE and cu_seqlens is not None and \
                self.lowering.residual is not None:
            path = generated.unlowered_path(device)
            why = ("packed sequences (cu_seqlens) and a chunk-local residual, whose chunks "
                   "would straddle the sequences' starts")
        generated.warn_once(self, device, path, why)
        if path == generated.TEMPLATE and group is None and cu_seqlens is None:
            short = self.lowering.planned_call(inputs, scale_v, initial_state,
                                               output_final_state, chunk_size)
            if short is not None:  # one GPU: the template's cached plan (and epilogue)
                return short
        grad = needs_grad(dict(inputs), initial_state)
        cu, strat, word = self._prepare(B=B, T=T, sizes=sizes, H=H, device=device,
                                        dtype=dtype, initial_state=initial_state,
                                        state_rows=state_rows, cu_seqlens=cu_seqlens,
                                        group=group, strategy=strategy, grad=grad)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        init = initial_state
        if self.vector and init is not None:
            init = init.reshape(-1, 1, K, 1)
        make_work = self._work_factory(scale_v, path, dtype, chunk_size)
        o, final = run(self.spec, inputs, make_work, (1, K, 1) if self.vector else (H, K, V),
                       B=B, T_local=T, initial_state=init, output_final_state=output_final_state,
                       cu=cu, group=group, strategy=strat, out_dtype=dtype,
                       compute_dtype=compute, device=device, word=word)
        if path == generated.TEMPLATE:  # the template's outputs, then what runs after
            o = self.lowering.finish(o, inputs, scale_v, chunk_size)
        if self.vector and final is not None:
            final = final.reshape(-1, K)
        return o, final

    def _bind(self, tensors, named) -> Dict[str, Tensor]:
        if len(tensors) > len(self.input_names):
            raise TypeError(f"{self.name}: takes {len(self.input_names)} tensors "
                            f"({', '.join(self.input_names)}), got {len(tensors)}")
        inputs = dict(zip(self.input_names, tensors))
        for k, t in named.items():
            if k not in self.inputs:
                raise TypeError(f"{self.name}: unexpected argument {k!r} (inputs: "
                                f"{', '.join(self.input_names)})")
            if k in inputs:
                raise TypeError(f"{self.name}: {k!r} given twice")
            inputs[k] = t
        missing = [n for n in self.input_names if n not in inputs or inputs[n] is None]
        if missing:
            raise TypeError(f"{self.name}: missing input(s) {', '.join(missing)}")
        return inputs

    def _prepare(self, *, B, T, sizes, H, device, dtype, initial_state, state_rows, cu_seqlens,
                 group, strategy, grad):
        """The checks of :mod:`forge_dist.ops.attention`, plus the variant's fingerprint in
        the cross-rank signature (every rank must run the same program)."""
        checks.group(group)
        _, size = p2p.rank_and_size(group)
        cu = checks.cu_seqlens(cu_seqlens, B, T * size, device)
        rows = B if cu is None else len(cu) - 1
        checks.initial_state(initial_state, (rows,) + tuple(state_rows), device)
        strat = sp.resolve(strategy, device, group) if size > 1 else None
        fields = {"B": B, "T (tokens per rank)": T, "H": H}
        fields.update({f"dim {k}": v for k, v in sorted(sizes.items())})
        fields.update({"dtype": dtype, "strategy": strategy,
                       "variant (program fingerprint)": self.fingerprint,
                       "cu_seqlens (number of offsets)": 0 if cu is None else len(cu),
                       "requires_grad (of any input, with grad mode on)": grad})
        data = {} if cu is None else {"cu_seqlens": tuple(cu)}
        word = checks.across_ranks(group, device, fields, data)
        return cu, strat, word

    def _work_factory(self, scale: float, path: str, out_dtype, chunk_size):
        use_triton = path == generated.TEMPLATE
        graphs = self._generated_graphs() if path == generated.GENERATED else None

        def make_work(part, need_M):
            if use_triton:
                work = self.lowering.make_work(part, scale, need_M, out_dtype=out_dtype)
                if work is not None:
                    return work
                if self.lowering.runs_after:  # (the residual, the epilogue: after)
                    return ChunkFormWork(lambda need: self.lowering.reference_summary(
                        part, scale, need, chunk_size), need_M)
            return ChunkFormWork(lambda need: self.summarize(part, scale, need, chunk_size,
                                                             graphs), need_M)
        return make_work


def variant(name: str, *, chunk_mode: Callable, decay_mode: Callable, merge_mode: Callable,
            state: str = "matrix", inputs: Optional[Union[Sequence[str], Dict[str, str]]] = None,
            chunk_size: Optional[int] = None, lower: bool = True,
            fuse_prologues: bool = False) -> Variant:
    """Compile a variant from its three phases (see the module docstring).

    Args:
        name: the variant's name (part of its cross-rank fingerprint).
        state: ``"matrix"`` (``[B, H, K, V]``) or ``"vector"`` (``[B, D]``).
        inputs: input names in call order, or ``{name: trailing dim}`` with dims ``"K"``,
            ``"V"``, ``""`` (per-head scalar) (vector state: ``"D"`` or ``""``).  Default: the
            parameter names of the callables in order of appearance, with ``q, k -> K``,
            ``v -> V``, anything else a per-head scalar (vector: ``D``).
        chunk_size: tokens per chunk (default 32).
        lower: try to map the variant onto a Triton template (CUDA only).
        fuse_prologues: apply the template inputs' elementwise prologues inside the
            template's kernels, to every tile they load (:mod:`.codegen`), instead of the
            default: one generated elementwise kernel per input before them for chains of
            two or more ops (:mod:`forge_dist.kernels.prologue`), PyTorch for single ops.
            Off by default because it measured slower on an H200
            (``scaling_benchmarks/results/dsl_prologue_NVIDIA-H200_2026-11-25_s24.json``,
            elu+1 linear attention at 64K tokens: forward 2.21 ms fused, 1.48 default, 2.29
            with PyTorch prologues; forward+backward 14.5, 6.5 and 7.3 ms).
    Raises:
        DSLError: the program cannot be compiled; the message names the op and source line.
    """
    return Variant(name, chunk_mode, decay_mode, merge_mode, state=state, inputs=inputs,
                   chunk_size=chunk_size, lower=lower, fuse_prologues=fuse_prologues)

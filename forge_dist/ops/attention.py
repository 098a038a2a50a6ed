"""The public ops: FLA's argument conventions, any device, optional sequence parallelism.

Every op returns ``(o, final_state)``; ``final_state`` is ``None`` unless
``output_final_state=True``.  With ``group`` (a ``torch.distributed`` process group) each
rank passes its contiguous shard of the sequence: rank r holds tokens
``[r * T, (r + 1) * T)`` of the global sequence, gets its shard's outputs and the state after
its shard (the last rank: the global final state).  ``initial_state`` is the state before the
first token and is read on rank 0.  With ``cu_seqlens`` (the *global* offsets of packed
sequences, ``B == 1``) sequences may straddle ranks; then ``initial_state`` is ``[N, ...]``
(pass the same tensor on every rank: rank r reads the rows of the sequences that begin on
it) and ``final_state`` is ``[N, ...]`` holding the rows of the sequences that end on this
rank (zeros elsewhere; a sum over ranks gives every final state).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels, sp
from ..config import env_reader
from ..runtime.sp_setup import sp_variants
from ..sp import agreement, p2p
from ..variants import decay_attention, delta_rule, vector_state
from ..variants.base import ChunkFormWork, VariantSpec
from ..variants.registry import GATED_DELTA_RULE, GLA, HGRN, LINEAR_ATTN, SIMPLE_GLA
from . import checks, planned
from .runner import needs_grad, run


_kernels_switch = env_reader("FORGE_DIST_KERNELS")  # read per call, by every layer piece


def _use_kernels(device: torch.device) -> bool:
    """Triton kernels for CUDA tensors unless ``FORGE_DIST_KERNELS=torch`` asks otherwise;
    ``FORGE_DIST_KERNELS=triton`` with ``TRITON_INTERPRET=1`` also runs them on CPU tensors
    (how CI exercises the GPU code path end to end)."""
    choice = _kernels_switch()
    choice = "auto" if choice is None else choice
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"FORGE_DIST_KERNELS: expected auto, triton or torch, got {choice!r}")
    if choice == "triton" and device.type != "cuda":
        return kernels.interpreting()
    return choice != "torch" and device.type == "cuda"


def _work_factory(spec: VariantSpec, chunk_form: Callable, scale, device, out_dtype):
    """``(segment inputs, need_M) -> SegmentWork``: Triton where supported, else PyTorch."""
    triton_ok = _use_kernels(device)

    def make_work(part, need_M):
        if triton_ok:
            work = kernels.make_work(spec.name, part, scale, need_M, out_dtype=out_dtype)
            if work is not None:
                return work
        return ChunkFormWork(lambda need: chunk_form(part, need), need_M)
    return make_work


def _prepare(spec: VariantSpec, *, B, T, dims, device, dtype, initial_state, state_rows_dims,
             cu_seqlens, group, strategy, gate_flags: int, grad: bool):
    """Checks shared by every op; returns ``(cu list, strategy object, signature word)``."""
    checks.group(group)
    rank, size = p2p.rank_and_size(group)
    cu = checks.cu_seqlens(cu_seqlens, B, T * size, device)
    if cu_seqlens is not None and cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens: expected a tensor on {device} or the CPU, got "
                         f"{cu_seqlens.device}")
    rows = B if cu is None else len(cu) - 1
    checks.initial_state(initial_state, (rows,) + tuple(state_rows_dims), device)
    # auto prices the passes by the state the chain carries: [B, H, K, V] (hgrn [B, 1, D, 1])
    state = (B, 1, state_rows_dims[0], 1) if spec.vector_state else (B,) + tuple(state_rows_dims)
    strat = sp.resolve(strategy, device, group, kind=spec.kind, state=state) if size > 1 else None
    if size == 1:
        return cu, strat, 0
    fields = agreement.op_fields(spec.name, B=B, T=T, dims=dims, dtype=dtype,
                                 strategy=strat.name,
                                 gates=agreement.GATE_NAMES[gate_flags],
                                 offsets=0 if cu is None else len(cu), grad=grad)
    # the offsets may change every call: compared on the host with a new signature, and
    # on the device (through the signature word) always
    data = {} if cu is None else {"cu_seqlens": tuple(cu)}
    word = checks.across_ranks(group, device, fields, data)
    return cu, strat, word


def _front(op: str, tensors, *, cu_seqlens, group, **kw):
    """:func:`planned.front` for calls it can take: ``(signature or None, result or None)``
    (one GPU, or a group for the ops with sequence-parallel plans)."""
    if cu_seqlens is not None or (group is not None and op not in sp_variants()):
        return None, None
    return planned.front(op, tensors, group=group, **kw)


def _matrix_op(spec: VariantSpec, q, k, v, gates: Dict[str, Optional[Tensor]],
               summarize: Callable, *, scale, initial_state, output_final_state, cu_seqlens,
               group, strategy, gate_flags: int, front_key=None
               ) -> Tuple[Tensor, Optional[Tensor]]:
    checks.tensor("q", q, [None, None, None, None])
    B, T, H, K = q.shape
    checks.tensor("k", k, [B, T, H, K])
    checks.tensor("v", v, [B, T, H, None])
    V = v.shape[-1]
    dtype = checks.same_dtype({"q": q, "k": k, "v": v})
    device = checks.same_device({"q": q, "k": k, "v": v, **gates,
                                 "initial_state": initial_state})
    scale = checks.scale(scale, K)
    checks.strategy(strategy)
    checks.group(group)
    short = planned.matrix_call(spec.name, q, k, v, gates, scale=scale,
                                initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                group=group, use_kernels=_use_kernels(device),
                                front_key=front_key, strategy=strategy)
    if short is not None:  # a cached plan (forge_dist/ops/planned.py)
        return short
    cu, strat, word = _prepare(spec, B=B, T=T, dims={"H": H, "K": K, "V": V}, device=device,
                         dtype=dtype, initial_state=initial_state, state_rows_dims=(H, K, V),
                         cu_seqlens=cu_seqlens, group=group, strategy=strategy,
                         gate_flags=gate_flags,
                         grad=needs_grad({"q": q, "k": k, "v": v, **gates}, initial_state))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # fp16 inputs run the kernels in fp32: the kernels feed chunk states to the tensor-core
    # dots in the input dtype, and a state (a sum of k v^T over many tokens) can pass fp16's
    # 65504 where the output is finite.  bf16 has fp32's range and stays the fast path.
    upcast = dtype == torch.float16 and _use_kernels(device)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    work_dtype = torch.float32 if upcast else dtype
    inputs = {"q": q, "k": k, "v": v, **gates}
    make_work = _work_factory(spec, lambda part, need: summarize(part, scale, need), scale,
                              device, work_dtype)
    o, final = run(spec, inputs, make_work, (H, K, V),
                   B=B, T_local=T, initial_state=initial_state,
                   output_final_state=output_final_state, cu=cu, group=group, strategy=strat,
                   out_dtype=work_dtype, compute_dtype=compute, device=device, word=word)
    return (o.to(dtype) if upcast else o), final


@checks.collective
def linear_attn(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None,
                initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                cu_seqlens: Optional[Tensor] = None, group=None, strategy: str = "auto"):
    """Linear attention, ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = (scale q_t)^T S_t``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), fp32.
    Returns:
        ``o [B, T, H, V]`` (dtype of q) and the fp32 final state or ``None``.
    """
    front_key, hit = _front("linear_attn", (q, k, v), cu_seqlens=cu_seqlens, group=group,
                            initial_state=initial_state,
                            output_final_state=output_final_state, scale=scale,
                            strategy=strategy)
    if hit is not None:
        return hit
    return _matrix_op(LINEAR_ATTN, q, k, v, {}, _decay_summarize, scale=scale,
                      initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, group=group, strategy=strategy, gate_flags=0,
                      front_key=front_key)


def _decay_summarize(p, s, need_M):
    """The PyTorch summary of a segment of linear_attn (no ``g``), simple_gla or gla:
    inputs by name."""
    return decay_attention.summarize(p["q"], p["k"], p["v"], p.get("g"), s,
                                     need_transition=need_M)


@checks.collective
def simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
               g_gamma: Optional[Tensor] = None, *, scale: Optional[float] = None,
               initial_state: Optional[Tensor] = None, output_final_state: bool = False,
               cu_seqlens: Optional[Tensor] = None, group=None, strategy: str = "auto"):
    """Scalar-decay linear attention, ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``.

    Args:
        g: ``[B, T, H]`` data-dependent log decays, and/or
        g_gamma: ``[H]`` constant per-head log decays (RetNet, Lightning); both add.
    """
    if g is None and g_gamma is None:
        return linear_attn(q, k, v, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           group=group, strategy=strategy)
    if g_gamma is not None:
        # a constant per-head decay is a data-dependent one that does not vary: written out
        # once (B*T*H fp32, a few microseconds), the call takes the same plans as any g
        checks.tensor("q", q, [None, None, None, None])
        B, T, H, _ = q.shape
        if g is not None:
            checks.tensor("g", g, [B, T, H])
        checks.tensor("g_gamma", g_gamma, [H])
        checks.same_device({"q": q, "g_gamma": g_gamma})
        expanded = g_gamma.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        expanded = expanded.expand(B, T, H)
        g = expanded.contiguous() if g is None else g + expanded
    front_key, hit = _front("simple_gla", (q, k, v, g), cu_seqlens=cu_seqlens,
                            group=group, initial_state=initial_state,
                            output_final_state=output_final_state, scale=scale,
                            strategy=strategy)
    if hit is not None:
        return hit
    checks.tensor("q", q, [None, None, None, None])
    B, T, H, _ = q.shape
    checks.tensor("g", g, [B, T, H])

    return _matrix_op(SIMPLE_GLA, q, k, v, {"g": g}, _decay_summarize, scale=scale,
                      initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, group=group, strategy=strategy, gate_flags=1,
                      front_key=front_key)


@checks.collective
def gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale: Optional[float] = None,
        initial_state: Optional[Tensor] = None, output_final_state: bool = False,
        cu_seqlens: Optional[Tensor] = None, group=None, strategy: str = "auto"):
    """Vector-decay (GLA) attention, ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``.

    Args:
        g: ``[B, T, H, K]`` log decays.
    """
    front_key, hit = _front("gla", (q, k, v, g), cu_seqlens=cu_seqlens, group=group,
                            initial_state=initial_state,
                            output_final_state=output_final_state, scale=scale,
                            strategy=strategy)
    if hit is not None:
        return hit
    checks.tensor("q", q, [None, None, None, None])
    checks.tensor("g", g, list(q.shape))

    return _matrix_op(GLA, q, k, v, {"g": g}, _decay_summarize, scale=scale,
                      initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, group=group, strategy=strategy, gate_flags=2,
                      front_key=front_key)


@checks.collective
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor, *,
                     scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                     output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None,
                     use_qk_l2norm_in_kernel: bool = False, group=None,
                     strategy: str = "auto"):
    """Gated delta rule, ``S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``.

    Args:
        k: ``[B, T, H, K]`` keys, L2-normalised over K (as FLA's layers give them), or pass
            ``use_qk_l2norm_in_kernel=True``.  Where ``b_t ||k_t||^2 > 2`` (raw keys of
            dimension K have ``||k||^2 ~ K``), ``I - b_t k_t k_t^T`` has an eigenvalue below
            -1: the state grows with every such token and a long sequence overflows to
            Inf/NaN (``FORGE_DIST_CHECK_FINITE=1`` names the first one).
        g: ``[B, T, H]`` log decays, or ``None`` for DeltaNet.
        beta: ``[B, T, H]`` write strengths in ``[0, 1]`` (FLA's layers take a sigmoid).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first, as
            FLA's flag of the same name does: ``x / sqrt(|x|^2 + 1e-6)``
            (:func:`forge_dist.variants.delta_rule.l2_normalize`).
    """
    front_key = None
    if not use_qk_l2norm_in_kernel:
        tensors = (q, k, v, g, beta) if g is not None else (q, k, v, beta)
        front_key, hit = _front("gated_delta_rule", tensors, cu_seqlens=cu_seqlens,
                                group=group, initial_state=initial_state,
                                output_final_state=output_final_state, scale=scale,
                                strategy=strategy)
        if hit is not None:
            return hit
    checks.tensor("q", q, [None, None, None, None])
    B, T, H, K = q.shape
    if g is not None:
        checks.tensor("g", g, [B, T, H])
    checks.tensor("beta", beta, [B, T, H])
    if use_qk_l2norm_in_kernel:
        q = delta_rule.l2_normalize(q)
        k = delta_rule.l2_normalize(checks.tensor("k", k, [B, T, H, K]))

    def summarize(p, s, need_M):
        return delta_rule.summarize(p["q"], p["k"], p["v"], p["g"], p["beta"], s,
                                    need_transition=need_M)
    return _matrix_op(GATED_DELTA_RULE, q, k, v, {"g": g, "beta": beta}, summarize,
                      scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      group=group, strategy=strategy, gate_flags=3 if g is not None else 4,
                      front_key=front_key)


@checks.collective
def hgrn(x: Tensor, g: Tensor, *, initial_state: Optional[Tensor] = None,
         output_final_state: bool = False, cu_seqlens: Optional[Tensor] = None, group=None,
         strategy: str = "auto"):
    """HGRN's vector recurrence, ``h_t = exp(g_t) * h_{t-1} + x_t``, ``o_t = h_t``.

    Args:
        x, g: ``[B, T, D]``.
        initial_state: ``[B, D]`` (``[N, D]`` with ``cu_seqlens``).
    Returns:
        ``o [B, T, D]`` and the fp32 final state ``[B, D]`` or ``None``.
    """
    front_key, hit = _front("hgrn", (x, g), cu_seqlens=cu_seqlens, group=group,
                            initial_state=initial_state,
                            output_final_state=output_final_state, strategy=strategy)
    if hit is not None:
        return hit
    checks.tensor("x", x, [None, None, None])
    B, T, D = x.shape
    checks.tensor("g", g, [B, T, D])
    device = checks.same_device({"x": x, "g": g, "initial_state": initial_state})
    checks.strategy(strategy)
    checks.group(group)
    short = planned.hgrn_call(x, g, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                              group=group, use_kernels=_use_kernels(device),
                              front_key=front_key, strategy=strategy)
    if short is not None:
        return short
    cu, strat, word = _prepare(HGRN, B=B, T=T, dims={"D": D}, device=device, dtype=x.dtype,
                         initial_state=initial_state, state_rows_dims=(D,),
                         cu_seqlens=cu_seqlens, group=group, strategy=strategy, gate_flags=5,
                         grad=needs_grad({"x": x, "g": g}, initial_state))
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    init = None if initial_state is None else initial_state.reshape(-1, 1, D, 1)

    make_work = _work_factory(
        HGRN, lambda p, need: vector_state.summarize(p["x"], p["g"], need_transition=need),
        None, device, x.dtype)
    o, final = run(HGRN, {"x": x, "g": g}, make_work, (1, D, 1), B=B, T_local=T,
                   initial_state=init, output_final_state=output_final_state, cu=cu,
                   group=group, strategy=strat, out_dtype=x.dtype, compute_dtype=compute,
                   device=device, word=word)
    return o, (None if final is None else final.reshape(-1, D))

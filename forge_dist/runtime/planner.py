"""The plan factory: :func:`plan` fixes everything about one op call once.

It checks the call's static facts (op, dims, dtypes, device, backend), builds the launch
programs the kernel modules describe (:func:`forge_dist.kernels.forward_program`: the
call's, and on a sequence-parallel rank that is not the last the summary's), binds them
to an :class:`~.executor.Executor` (cubins from the AOT cache, or the JIT) and returns a
:class:`~.plan.Plan`; sequence-parallel plans get their strategy, state workspaces and
channels from :mod:`.sp_setup`.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import kernels
from ..comm.channel import SimRank
from ..variants import registry
from ..variants.transitions import Kind
from . import fastpath, sp_setup, sp_train
from .sp_setup import sp_variants
from .aot import CubinCache, default_cache_dir
from .dispatcher import Dispatcher
from .executor import Executor
from .plan import Plan, PlanError



def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rank_size(group) -> Tuple[int, int, bool]:
    """``(rank, size, simulated)`` for ``None``, a process group or a ``SimRank``."""
    if group is None:
        return 0, 1, False
    if isinstance(group, SimRank):
        return group.rank, group.world.size, True
    return dist.get_rank(group), dist.get_world_size(group), False


def _static_cache(device: torch.device, cache_dir):
    major, minor = torch.cuda.get_device_capability(device)
    return CubinCache(cache_dir if cache_dir is not None else default_cache_dir(),
                      target=f"cuda:{major}{minor}")


def plan(op: str, *, B: int, T: int, H: Optional[int] = None, K: Optional[int] = None,
         V: Optional[int] = None, D: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
         gate_dtype: Optional[torch.dtype] = None, gated: Optional[bool] = None,
         beta_dtype: Optional[torch.dtype] = None, initial_state: bool = False,
         output_final_state: bool = False, scale: Optional[float] = None, device=None,
         group=None, strategy: str = "auto",
         execution: Optional[str] = None, backend: str = "auto", cache_dir=None,
         tiles: Optional[dict] = None, dispatcher=None, maps=None, train: bool = False) -> Plan:
    """Plan one op call (see :mod:`.plan`).

    Args:
        op: a registered variant with kernels (:func:`forge_dist.kernels.variants`).
        B, T: batch and tokens per rank; H, K, V: heads and head dims (hgrn: ``D``).
        dtype: of q/k/v (hgrn x); ``gate_dtype`` of g/beta (default fp32; hgrn: ``dtype``);
            ``beta_dtype`` of the delta rule's beta when it differs from g's.
        gated: ops with an optional gate: with a ``g`` input (default True); linear_attn
            never, gla always.
        initial_state / output_final_state: whether run takes / returns the fp32 state.
        group: ``None``, a process group, or a ``forge_dist.comm.sim.SimRank``.
        strategy: sequence-parallel strategy (``forge``, ``lasp2``, ...; ``auto``).
        execution: ``fused`` / ``decoupled`` / ``None`` (the kernels' scheduler).
        backend: ``auto``, ``static``, ``triton`` or ``torch``.
        cache_dir: AOT cache for the static backend (default: ``FORGE_DIST_AOT_CACHE`` or
            ``~/.cache/forge_dist/aot``).
        tiles: overrides of the kernels' tile config (e.g. ``{"BT": 32}``).
        dispatcher: a :class:`~.dispatcher.Dispatcher` to use (tests inject fakes).
        maps: fused elementwise prologues, input name -> jitted map (a dict or its items;
            :mod:`forge_dist.dsl.codegen`): the kernels map each input as they load it.
            JIT-launched (the AOT cache holds no such kernels); not for the delta rule.
        train: a sequence-parallel plan whose runs are differentiated
            (:meth:`.plan.Plan.run_train`, :mod:`.sp_train`): its ranks keep the folded
            summary ``(M, delta)`` for every strategy's forward and backward chains.
    """
    maps = {n: m for n, m in dict(maps or {}).items() if m is not None}
    if op not in kernels.variants():
        raise PlanError(f"op: expected one of {kernels.variants()}, got {op!r}")
    spec = registry.get(op)
    if backend not in ("auto", "static", "triton", "torch"):
        raise PlanError(f"backend: expected auto, static, triton or torch, got {backend!r}")
    if execution not in (None, "auto", "fused", "decoupled"):
        raise PlanError(f"execution: expected fused, decoupled or None, got {execution!r}")
    for name, val in (("B", B), ("T", T)):
        if not isinstance(val, int) or val < 1:
            raise PlanError(f"{name}: expected a positive int, got {val!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise PlanError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rank, size, simulated = _rank_size(group)

    if backend == "auto":
        if device.type == "cuda":
            backend = "static" if dispatcher is not None else "triton"
            if dispatcher is None:
                cache = _static_cache(device, cache_dir)
                if any(cache.stale(k) is None for k in cache._all):
                    backend = "static"
        else:
            backend = "triton" if _interpreting() else "torch"
    if backend in ("static", "triton") and device.type != "cuda" and not _interpreting():
        if not (backend == "static" and dispatcher is not None):
            raise PlanError(f"backend={backend!r}: tensors on {device} need CUDA, or "
                            "TRITON_INTERPRET=1 set before Triton is imported")
    if train and size == 1:
        raise PlanError("train: a sequence-parallel plan option (give a group of more "
                        "than one rank); one-device plans differentiate with run_backward")
    if train and maps:
        raise PlanError("train: the backward programs do not differentiate fused "
                        "prologues (maps); use forge_dist.ops for gradients")
    if size > 1 and backend == "torch":
        raise PlanError("backend='torch' plans are single-rank; use forge_dist.ops with a group")

    # programs for the interpreter use its precision rule; static plans are built for the GPU
    interp = backend != "static" and _interpreting() and device.type != "cuda"
    notes: List[str] = []
    if spec.vector_state:
        if D is None or D < 1:
            raise PlanError(f"{op}: give D (the feature dim of x [B, T, D])")
        gdt = gate_dtype or dtype
        if set(maps) - {"x", "g"}:
            raise PlanError(f"maps: {op} maps x and g, got {sorted(maps)}")
        gated = True  # its transition is the gate's decay
        # across ranks: the state [B, D] passes in the runtime layout [B, 1, D, 1]
        H, K, V = 1, D, 1
        summary = "none"
        if size > 1:
            strategy_name, strategy_obj = sp_setup.resolve_strategy(
                strategy, simulated, device, group, kind=spec.kind, state=(B, 1, D, 1))
            summary = "folded" if rank < size - 1 else "incoming"
        prog = kernels.forward_program(op, B=B, T=T, D=D, dtype=dtype,
                                       has_h0=initial_state or rank > 0, tiles=tiles,
                                       gate_dtype=gdt, execution=execution, maps=maps,
                                       summary=summary)
        names = list(spec.inputs)
        state_shape = (B, D)
        out_shape = (B, T, D)
    else:
        for name, val in (("H", H), ("K", K), ("V", V)):
            if not isinstance(val, int) or val < 1:
                raise PlanError(f"{name}: expected a positive int, got {val!r}")
        if K < 16 or V < 16 or K > 256 or V > 256:
            raise PlanError(f"head dims K={K}, V={V} outside [16, 256] (the kernels' range)")
        if gated is None:
            gated = spec.gate is not None
        gdt = gate_dtype or torch.float32
        scale = K ** -0.5 if scale is None else float(scale)
        # a sequence-parallel rank but the last keeps its summaries for the state pass,
        # which runs between them and the output walks (its last launch)
        summary = "none"
        if size > 1:
            strategy_name, strategy_obj = sp_setup.resolve_strategy(
                strategy, simulated, device, group, kind=spec.kind, state=(B, H, K, V))
            if rank < size - 1:
                summary = sp_setup.summary_form(op, rank, initial_state, train, strategy_obj)
        try:
            prog = kernels.forward_program(
                op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, gated=gated,
                has_h0=initial_state or rank > 0, scale=scale, execution=execution,
                interp=interp, tiles=tiles, gate_dtype=gdt, beta_dtype=beta_dtype, maps=maps,
                summary=summary)
        except ValueError as err:
            raise PlanError(str(err)) from None
        names = list(spec.input_names(gated))
        state_shape = (B, H, K, V)
        out_shape = (B, T, H, V)
    notes.extend(prog.notes)
    if maps:
        notes.append(f"fused prologues on {', '.join(sorted(maps))}")

    if backend == "static" and dispatcher is None:
        dispatcher = Dispatcher(_static_cache(device, cache_dir))
    disp = dispatcher if backend == "static" else None
    finish_exec = None
    if backend != "torch":
        finish_exec = Executor(prog, device, disp)
        if disp is not None:
            jit = [p for p in finish_exec.paths if p.startswith("jit")]
            if jit:
                notes.append(f"{len(jit)} launch(es) fall back to the JIT: {jit}")

    shapes = {n: prog.buffers[n].shape for n in names}
    dtypes = {n: prog.buffers[n].dtype for n in names}
    p = Plan(op=op, backend=backend, device=device, input_names=names, shapes=shapes,
             dtypes=dtypes, initial_state=bool(initial_state),
             output_final_state=bool(output_final_state), scale=scale,
             state_shape=state_shape, ht_shape=prog.buffers["ht"].shape, out_shape=out_shape,
             out_dtype=dtype, execution=prog.execution, notes=notes, rank=rank, size=size,
             group=group, strategy=None, strategy_obj=None,
             # an ungated call (simple_gla without g) passes its state with no decay; the
             # delta rule's transition stays dense without g (beta)
             kind=(None if op not in sp_variants() else
                   Kind.IDENTITY.value if not gated and spec.kind is not Kind.DENSE
                   else spec.kind.value),
             finish_exec=finish_exec, channels=None, sp_split=len(prog.launches) - 1,
             static=backend == "static", s_in=None, zeros=None, _ht_scratch=None,
             execution_request=execution, _dispatcher=disp, _bwd_execs={}, _interp=interp,
             prologues=tuple(sorted(maps)), word=0, _pass_keep={}, train=bool(train),
             _state_grad_execs={}, _backward_part_execs={},
             _specialise_pending=backend == "triton" and device.type == "cuda")

    if backend != "torch" and not output_final_state:
        # the kernels write a final state nobody returns: one scratch for every run
        p._ht_scratch = torch.empty(p.ht_shape, dtype=torch.float32, device=device)
    if size > 1:
        p.strategy, p.strategy_obj = strategy_name, strategy_obj
        if train and spec.vector_state:
            try:  # its backward must split around the reverse chain (decoupled)
                sp_train.vector_backward_program(p, has_dht=True)
            except ValueError as err:
                raise PlanError(str(err)) from None
        sp_setup.setup(p, simulated, B, T, H, K, V, dtype, gated,
                       dims={"D": D} if spec.vector_state else None)
    fast = fastpath.specialise(p)
    if fast is not None:
        p.run = fast  # straight-line checks and launches; the general path on any miss
    return p

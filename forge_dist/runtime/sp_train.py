"""Sequence-parallel training through a plan: a differentiated run on one rank of a group.

A plan made with ``train=True`` (:func:`.planner.plan`; the ops make one for a repeated call
with gradients and a group) runs its forward as an inference plan does -- the program's
summary launches, the strategy's forward chain, the output walks from the incoming state
``S_in`` -- and keeps ``S_in``, the shard's transition ``M`` and what the strategy's
backward chain needs (:class:`Kept`).

Its backward on rank ``r`` (``lam(r)``: the gradient of the loss with respect to ``S_in(r)``,
``docs/design.md`` section 2) is three steps, with no autograd graph in between:

1. ``lam_own``: the gradient of ``S_in(r)`` through this shard's own outputs and final state
   alone, one reverse walk that stores no chunk states
   (:func:`forge_dist.kernels.state_grad_program`); rank 0 skips it (nobody reads its
   ``lam``), and the last rank, whose backward needs nothing from the chain, runs its
   backward's own reverse walk first instead, whose ``dh0`` is its whole ``lam``;
2. the strategy's backward chain: ``lam(r+1)`` arrives, ``lam(r) = lam_own + M^T lam(r+1)``
   leaves for rank ``r - 1``;
3. the one-device backward program with ``h0 = S_in(r)`` and ``dht = lam(r+1)`` (plus the
   gradient of the returned final state): every gradient of this rank's inputs, and on
   rank 0 the initial state's (its ``dh0`` is ``lam(0)``).  Its forward chunk-state walk
   needs no ``lam(r+1)``: it runs before the chain, while the chain waits
   (:meth:`forge_dist.kernels.ir.Program.parts`; the delta rule's ranks between the first
   and the last run it after, below).

A rank thus runs the one-device backward of its shard plus one state-gradient walk (which
reads q, do and the gates once; the delta rule's also k and its WY factor w), and waits
only for the chain, never for another rank's whole backward.  The general path's backward
instead differentiates the summary separately, which reads k and v again and writes their
gradients twice.

hgrn (a vector state, :func:`_backward_vector`) follows the same three steps on its
decoupled backward program (each segment's outgoing gradient from a zero start, the
reverse scan over segments, the walk that writes ``dx, dg``): ``lam_own`` is the scan
alone on copies of the segments' gradients (the walk before it is the program's own
first launch, so it costs one small scan), and the last rank's whole ``lam`` is its
program's scan with the final-state gradient it already has.

The delta rule (a dense transition ``M [B, H, K, K]``, kept as a copy: the plan's next
forward rewrites its workspace) forms its WY factors first on every rank. The last rank
then runs its reverse state walk, which reads only those factors and the inputs, and sends
its ``dh0``. Rank 0 runs its chunk-state walk while the chain waits. A rank between them
runs its ``lam_own`` walk on the factors it already formed, then the chain, then the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels
from ..sp import phases
from ..sp.base import folded_forward_chain
from ..variants import registry
from ..variants.transitions import Kind
from .executor import Executor


@dataclass
class Kept:
    """What a training run keeps for its backward: ``S_in`` ``[B, H, K, V]`` fp32 (hgrn:
    ``[B, 1, D, 1]``; the incoming state the output walks started from; rank 0: the initial
    state or zeros), ``M`` (this rank's shard transition, ``None`` for the identity kind and
    on the last rank) and the strategy's ``saved``."""

    S_in: Tensor
    M: Optional[Tensor]
    saved: Any


def forward(p, tensors: Dict[str, Tensor], h0: Optional[Tensor], o: Tensor
            ) -> Tuple[Tensor, Optional[Tensor], Kept]:
    """One rank's forward of plan ``p`` (checked ``tensors`` by input name, ``o`` the output
    buffer): ``(o, final_state or None, kept)``.  No host synchronisation."""
    rank = p.rank
    ht = (torch.empty(p.ht_shape, dtype=torch.float32, device=p.device)
          if p.output_final_state else p._ht_scratch)
    tensors["o"], tensors["ht"] = o, ht
    exe, split = p.finish_exec, p.sp_split
    exe.run_range(tensors, 0, split)
    S0 = (h0 if h0 is not None else p.zeros) if rank == 0 else p.zeros
    if S0.dim() != 4:  # hgrn's [B, D] state passes as [B, 1, D, 1] (forge_dist.sp's layout)
        S0 = S0.view(p.zeros.shape)
    with phases.STATE_PASS:
        S_in, M, saved = folded_forward_chain(p.strategy_obj, Kind(p.kind), exe.workspaces, S0,
                                              p.group, p.word, p._pass_keep)
    if rank > 0 and p._pass_keep:
        # a strategy's kept buffer (scan's rounds) is rewritten by the plan's next forward,
        # which may come before this run's backward (two layers on one plan)
        S_in = S_in.clone()
    if M is not None and Kind(p.kind) is Kind.DENSE:
        M = M.clone()  # the delta rule's transition is a workspace: the same holds for it
    if rank > 0 or h0 is not None:
        tensors["h0"] = S_in
    exe.run_range(tensors, split, len(exe.program.launches))
    return o, (ht if p.output_final_state else None), Kept(S_in, M, saved)


def _state_grad_exec(p, has_dht: bool) -> Executor:
    """``lam_own``'s program (:func:`forge_dist.kernels.state_grad_program`).  The delta
    rule's reads the WY factor ``w`` that the rank's first part of the backward already
    formed (its own WY launches cut off), so a rank forms the factors once."""
    exe = p._state_grad_execs.get(has_dht)
    if exe is None:
        B, T, H, K = p.shapes["q"]
        prog = kernels.state_grad_program(p.op, B=B, T=T, H=H, K=K, V=p.out_shape[-1],
                                          dtype=p.out_dtype, has_dht=has_dht,
                                          gated="g" in p.shapes, scale=p.scale,
                                          interp=p._interp, sms=kernels.sm_count(p.device))
        if Kind(p.kind) is Kind.DENSE:  # the reverse walk alone, w an input
            walk = [i for i, ln in enumerate(prog.launches) if ln.kernel == "delta_dstates"]
            wy = [i for i in range(len(prog.launches)) if i not in walk]
            prog = prog.parts([wy, walk])[1]
        exe = p._state_grad_execs[has_dht] = Executor(prog, p.device, None)
    return exe


# The launches of a rank's first part of the backward, before the reverse chain, by kernel
# name; the rest run after it.  The last rank runs its reverse state walk there (its dh0 is
# all of its lam); rank 0 the forward chunk-state walk (it needs no lam(r+1), so it runs
# while the chain waits); a rank between them, of the delta rule, only the WY factors, whose
# w its own state gradient reads, so that lam(r) leaves as soon as lam(r+1) comes.
_FIRST_PART = {("diagonal", "last"): ("chunk_states_bwd",),
               ("diagonal", "first"): ("chunk_states",),
               ("diagonal", "middle"): ("chunk_states",),
               ("dense", "last"): ("wy", "delta_dstates"),
               ("dense", "first"): ("wy", "gate_cumsum", "walk"),
               ("dense", "middle"): ("wy",)}


def _backward_parts(p, has_dht: bool, role: str) -> Tuple[Executor, Executor]:
    """The one-device backward program of ``p`` cut around the reverse chain, the first
    part's launches those :data:`_FIRST_PART` names for the rank's ``role`` (``"last"``,
    ``"first"``: rank 0, ``"middle"``; for the identity, scalar and diagonal kinds rank 0
    and the middle ranks cut at the same launch, and share the executors)."""
    family = "dense" if Kind(p.kind) is Kind.DENSE else "diagonal"
    names = _FIRST_PART[family, role]
    key = (has_dht, names)
    parts = p._backward_part_execs.get(key)
    if parts is None:
        prog = p._backward_exec(has_dht).program
        first = [i for i, ln in enumerate(prog.launches) if ln.kernel in names]
        rest = [i for i in range(len(prog.launches)) if i not in first]
        parts = p._backward_part_execs[key] = tuple(
            Executor(part, p.device, p._dispatcher, specialise=True)
            for part in prog.parts([first, rest]))
    return parts


def _run_part(exe: Executor, given: Dict[str, Tensor], device) -> None:
    """Run one part on the buffers of ``given`` it names (exactly those: the executor's
    straight-line call takes no others) and put its outputs into ``given``.  A part
    without scratch gets its outputs allocated here (a scoped one allocates its own)."""
    mine = {}
    for name, buf in exe.program.buffers.items():
        if name in given:
            mine[name] = given[name]
        elif buf.role == "output" and not exe._scoped:
            mine[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
    exe(mine)
    for name, buf in exe.program.buffers.items():
        if buf.role == "output":
            given[name] = mine[name]


def vector_backward_program(p, has_dht: bool):
    """hgrn's backward program for a training plan's rank: decoupled (the state gradient
    needs the segments' own gradients before the walk that writes ``dx, dg``), three
    launches: the segments' walk from zero, the reverse scan, the gradient walk.  Raises
    ``ValueError`` where the shard is one segment (the planner then refuses the plan)."""
    B, T, D = p.out_shape
    prog = kernels.backward_program(p.op, B=B, T=T, D=D, dtype=p.out_dtype,
                                    gate_dtype=p.dtypes["g"],
                                    has_h0=p.initial_state or p.rank > 0, has_dht=has_dht,
                                    execution="decoupled")
    if len(prog.launches) != 3:
        raise ValueError(f"train: hgrn's backward of a {T}-token shard is one segment; "
                         "its training across ranks takes the general path")
    return prog


def _vector_parts(p, has_dht: bool, last: bool) -> Tuple[Executor, Executor]:
    """:func:`vector_backward_program` cut around the reverse chain: the last rank runs the
    segments' walk and the scan first (the scan leaves its whole ``lam`` in ``gout[0]``),
    every other rank the walk alone."""
    key = ("vector", has_dht, last)
    parts = p._backward_part_execs.get(key)
    if parts is None:
        groups = [[0, 1], [2]] if last else [[0], [1, 2]]
        parts = p._backward_part_execs[key] = tuple(
            Executor(part, p.device, p._dispatcher, specialise=True)
            for part in vector_backward_program(p, has_dht).parts(groups))
    return parts


def _vector_state_grad(p, has_dht: bool, n_seg: int) -> Executor:
    """hgrn's reverse scan alone (:func:`forge_dist.kernels.state_grad_program`) over the
    backward's ``n_seg`` segments: a rank's own share of ``lam(r)`` from a copy of its
    segments' gradients and their log decays."""
    exe = p._state_grad_execs.get(("vector", has_dht))
    if exe is None:
        B, T, D = p.out_shape
        prog = kernels.state_grad_program(p.op, B=B, T=T, D=D, n_seg=n_seg, dtype=p.out_dtype,
                                          has_dht=has_dht)
        exe = p._state_grad_execs[("vector", has_dht)] = Executor(prog, p.device, None)
    return exe


def _backward_vector(p, given: Dict[str, Tensor], do: Tensor, dht: Optional[Tensor],
                     kept: Kept, need_initial_grad: bool) -> Tuple[Optional[Tensor], ...]:
    """:func:`backward` for hgrn (state ``[B, D]``, passed as ``[B, 1, D, 1]``)."""
    rank, last = p.rank, p.rank == p.size - 1
    B, _, D = p.out_shape
    t = {"g": given["g"], "h": given["h"], "do": do}
    if rank > 0 or p.initial_state:
        t["h0"] = kept.S_in.reshape(B, D)
    if last:
        if dht is not None:
            t["dht"] = dht
        first, rest = _vector_parts(p, dht is not None, last=True)
        _run_part(first, t, p.device)
        # (a copy: the gradient walk after the chain rewrites gout, and a baseline's send
        # may still be reading it)
        lam_own = t["gout"][0].clone()
    else:
        first, rest = _vector_parts(p, True, last=False)
        _run_part(first, t, p.device)
        if rank > 0:  # 1. this shard's own share of lam(r): the scan on a copy
            lam_own = torch.empty(B, D, dtype=torch.float32, device=p.device)
            own = {"cs": t["cout"].clone(), "gs": t["gout"], "lam": lam_own}
            if dht is not None:
                own["dht"] = dht
            _vector_state_grad(p, dht is not None, t["cout"].shape[0])(own)
        else:  # rank 0 sends nothing back
            lam_own = p.zeros
    with phases.BACKWARD_CHAIN:  # 2. lam(r+1) in, lam(r) out
        lam_next, _ = p.strategy_obj.backward_chain(Kind(p.kind), kept.M,
                                                    lam_own.view(p.zeros.shape), p.group,
                                                    kept.saved, p.word, p._pass_keep)
    if not last:  # 3. the scan and the gradient walk from the end state's whole gradient
        lam_next = lam_next.reshape(B, D)
        t["dht"] = lam_next if dht is None else lam_next + dht
    _run_part(rest, t, p.device)
    dS0 = (t["cout"][0].clone() if rank == 0 and need_initial_grad and p.initial_state
           else None)
    return t["dx"], t["dg"], dS0


def backward(p, given: Dict[str, Tensor], do: Tensor, dht: Optional[Tensor], kept: Kept,
             need_initial_grad: bool) -> Tuple[Optional[Tensor], ...]:
    """Gradients of one :func:`forward` of plan ``p``: those of ``p.input_names``, then the
    initial state's (rank 0 with ``need_initial_grad``, else ``None``).  ``given``: the
    inputs the run took, by name (checked); ``do``: ``o``'s shape and dtype; ``dht``: the
    gradient of the returned final state (fp32) or ``None``; hgrn's ``given``: ``g`` and
    ``h``, the run's outputs (its states)."""
    if registry.get(p.op).vector_state:
        return _backward_vector(p, given, do, dht, kept, need_initial_grad)
    rank, size = p.rank, p.size
    last = rank == size - 1
    g = given.get("g")
    if g is not None and g.dtype != torch.float32:  # the backward kernels read fp32 gates
        given["g"] = g.float()
    given["do"] = do
    if rank > 0 or p.initial_state:
        given["h0"] = kept.S_in
    if last:
        # the whole backward has its final gradient already: its reverse state walk (in
        # the first part) leaves the whole lam(r) in dh0 for the chain, the rest runs after
        if dht is not None:
            given["dht"] = dht
        first, rest = _backward_parts(p, dht is not None, "last")
        _run_part(first, given, p.device)
        lam_own = given.pop("dh0")
    else:
        first, rest = _backward_parts(p, True, "middle" if rank > 0 else "first")
        dense = Kind(p.kind) is Kind.DENSE
        if dense:  # the WY factors first: the state gradient below reads their w
            _run_part(first, given, p.device)
        if rank > 0:  # 1. this shard's own share of lam(r), before the chain needs it
            lam_own = torch.empty(p.state_shape, dtype=torch.float32, device=p.device)
            exe = _state_grad_exec(p, dht is not None)
            own = {n: given[n] for n, buf in exe.program.buffers.items()
                   if buf.role == "input" and n != "dht"}
            own["dh0"] = lam_own
            if dht is not None:
                own["dht"] = dht
            exe(own)
        else:  # rank 0 sends nothing back: its lam(0) comes from step 3
            lam_own = p.zeros
        if not dense:
            _run_part(first, given, p.device)  # the chunk states: no lam(r+1) needed
    with phases.BACKWARD_CHAIN:  # 2. lam(r+1) in, lam(r) out
        # (lam_next may be a kept buffer of the strategy: read in step 3, before any other
        # backward of this plan)
        lam_next, _ = p.strategy_obj.backward_chain(Kind(p.kind), kept.M, lam_own, p.group,
                                                    kept.saved, p.word, p._pass_keep)
    if not last:  # 3. the rest of the backward, with the gradient of the shard's end state
        given["dht"] = lam_next if dht is None else lam_next + dht
    _run_part(rest, given, p.device)
    if "dg_part" in given:  # simple_gla: the K tiles' shares of dg
        given["dg"] = kernels.summed_gate_grad(given["dg_part"])
    grads = [given["dq"], given["dk"], given["dv"]]
    if g is not None:
        grads.append(given["dg"].to(g.dtype))
    if "beta" in p.input_names:
        grads.append(given["dbeta"].to(p.dtypes["beta"]))
    dS0 = given.get("dh0") if rank == 0 and need_initial_grad else None
    return (*grads, dS0)

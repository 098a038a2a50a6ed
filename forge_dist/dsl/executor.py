"""Executor: runs the traced graphs in the chunk-wise three-phase form (any device, autograd).

This is an *executor*, not generated code: the ``torch.fx`` graph modules of the three
callables are called on chunked tensors, and the results are assembled into the runtime's
:class:`~forge_dist.variants.base.SegmentSummary` contract, so :func:`forge_dist.ops.runner.run`,
every strategy, ``cu_seqlens`` and autograd work unchanged.  Per segment of ``L`` tokens:

1. chunk_mode on ``[B, H, NT, C, *]`` chunks -> per-chunk zero-start states ``dS_c`` and caches;
   a ragged tail of ``r < C`` tokens runs as its own chunk of length ``r`` (the graphs have a
   symbolic chunk length), so no token is ever padded;
2. decay_mode -> the chunk transitions: ``b_c = f_c(0)`` and ``M_c`` from its linear part
   (``A_c(ones)`` for scalar / diagonal kinds, ``A_c(I_K)`` for dense), then the in-segment scan;
3. merge_mode on the chunk-start states -> outputs; the incoming state's contribution is the
   linear part of merge_mode applied to the carried states (``readout``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..variants import chunked as ck
from ..variants.base import SegmentSummary
from ..variants.transitions import Kind
from .generated import eager_graphs


def chunk_inputs(compiled, part: Dict[str, Tensor], lo: int, hi: int, C: int,
                 dtype: torch.dtype) -> Dict[str, Tensor]:
    """Token tensors ``[B, L, H, *]`` (vector: ``[B, L, *]``) -> chunks ``[B, H, NT, C, *]``
    (vector: ``[B, NT, C, *]``) for tokens ``[lo, hi)`` (``hi - lo`` a multiple of ``C``)."""
    out = {}
    for name in compiled.input_names:
        t = part[name][:, lo:hi].to(dtype)
        if compiled.vector:
            out[name] = ck.to_chunks(t[:, :, None], C)[:, 0]
        else:
            out[name] = ck.to_chunks(t, C)
    return out


def call(gm, params, args):
    """``gm`` on the arguments it takes, by parameter name."""
    return gm(*[args[p] for p in params])


def to_internal(compiled, S: Tensor) -> Tensor:
    """User per-chunk state (``[B, H, NT, K, V]`` / vector ``[B, NT, D]``) -> ``[B, H, NT, K, V]``."""
    return S[:, None, :, :, None] if compiled.vector else S


def to_user(compiled, S: Tensor) -> Tensor:
    return S[:, 0, :, :, 0] if compiled.vector else S


def transitions(compiled, args: dict, like: Tensor, lin=None) -> Optional[Tensor]:
    """Per-chunk transitions ``M_c`` in the runtime layout (see transitions.py), from the
    linear part of decay_mode (``lin``: its callable, default the graph module).  ``like``:
    a user-layout per-chunk state."""
    kind = compiled.kind
    lin = compiled.decay_linear if lin is None else lin
    params = compiled.decay.params
    if kind is Kind.IDENTITY:
        return None
    if kind is Kind.DENSE:
        B, H, NT, K, _ = like.shape
        eye = torch.eye(K, dtype=like.dtype, device=like.device).expand(B, H, NT, K, K)
        return call(lin, params, {**args, "state": eye})
    if not compiled.vector:
        # rows are scaled by factors constant along V (the analysis checked it): one column
        # of ones gives them without a K x V product per chunk; anything shape-bound falls
        # back to the full state
        ones = like.new_ones(()).expand(like.shape[:-1] + (1,))
        try:
            M = call(lin, params, {**args, "state": ones})
        except Exception:  # noqa: BLE001 - a program that needs the state's V size
            M = None
        if M is not None and M.shape[:-1] == like.shape[:-1]:
            return M[..., 0, 0] if kind is Kind.SCALAR else M[..., :, 0]
    M = call(lin, params, {**args, "state": torch.ones_like(like)})
    if compiled.vector:  # [B, NT, D] -> [B, 1, NT(, D)]
        return (M[..., 0] if kind is Kind.SCALAR else M)[:, None]
    return M[..., 0, 0] if kind is Kind.SCALAR else M[..., :, 0]


def pieces(L: int, C: int) -> List[Tuple[int, int, int]]:
    """``(lo, hi, chunk length)``: the whole chunks of ``L`` tokens, then the ragged tail as
    one chunk of its own length."""
    out = [(0, (L // C) * C, C)] if L // C else []
    if L % C:
        out.append(((L // C) * C, L, L % C))
    return out


def summarize(compiled, part: Dict[str, Tensor], scale: float, need_transition: bool,
              chunk_size: Optional[int] = None, graphs=None) -> SegmentSummary:
    """The :class:`SegmentSummary` of one segment (see module docstring).

    Args:
        part: the segment's token tensors by input name (token axis at dim 1).
        scale: the value of the ``scale`` parameter.
        graphs: the :class:`~.generated.Graphs` to run (default the traced graph modules;
            the generated path passes their compiled forms).
    """
    graphs = graphs or eager_graphs(compiled)
    first = part[compiled.input_names[0]]
    dtype = ck.compute_dtype(first)
    L = first.shape[1]
    C = chunk_size or compiled.chunk_size
    parts = pieces(L, C)

    args_list, Ms, bs = [], [], []
    for lo, hi, Cp in parts:
        args = chunk_inputs(compiled, part, lo, hi, Cp, dtype)
        args["scale"] = scale
        out = call(graphs.chunk, compiled.chunk.params, args)
        out = out if isinstance(out, tuple) else (out,)
        dS = out[0]
        args.update(zip(compiled.chunk.cached, out[1:]))
        args["chunk_state"] = dS
        if getattr(compiled, "decay_offset", None) is not None:
            b = args[compiled.decay_offset]  # decay_mode(0): its offset argument
        else:
            zero = dS.new_zeros(()).expand(dS.shape)  # no memory: a stride-0 view
            b = call(graphs.decay, compiled.decay.params, {**args, "state": zero})
        Ms.append(transitions(compiled, args, dS, graphs.decay_linear))
        bs.append(to_internal(compiled, b))
        args_list.append(args)
    kind = compiled.kind
    cat = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts, dim=2)  # noqa: E731
    M_c = None if kind is Kind.IDENTITY else cat(Ms)
    b_c = cat(bs)
    starts, delta = graphs.scan(kind, M_c, b_c)

    def outputs(gm, states: Tensor) -> Tensor:
        o, nt0 = [], 0
        for (lo, hi, Cp), args in zip(parts, args_list):
            nt = (hi - lo) // Cp
            S = to_user(compiled, states[:, :, nt0:nt0 + nt])
            nt0 += nt
            oc = call(gm, compiled.merge.params, {**args, "state": S})
            if compiled.vector:  # [B, NT, C, D] -> [B, L, D]
                o.append(oc.reshape(oc.shape[0], -1, oc.shape[-1]))
            else:
                o.append(ck.from_chunks(oc, hi - lo))
        return torch.cat(o, dim=1) if len(o) > 1 else o[0]

    o_zero = outputs(graphs.merge, starts)

    def readout(S_in: Tensor):
        carried, end = graphs.scan(kind, M_c, torch.zeros_like(b_c), S_in.to(b_c.dtype))
        return outputs(graphs.merge_linear, carried), end

    M = ck.chain_transitions(kind, M_c) if need_transition else None
    return SegmentSummary(o_zero, delta, M, readout)

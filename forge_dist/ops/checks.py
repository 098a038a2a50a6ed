"""Argument checks for every public op: clear errors before any communication or launch.

Each error names the argument and what was expected.  Checks that need other ranks (shard
lengths, shapes, dtypes, strategy) run as one small all-gather of a signature, so every rank
raises the same error together instead of some ranks hanging in a later collective.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from ..sp import p2p

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def tensor(name: str, t, dims: Sequence[Optional[int]], *, floating: bool = True) -> Tensor:
    """``t`` must be a tensor of ``len(dims)`` dims matching ``dims`` (``None`` = any size)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(dims):
        raise ValueError(f"{name}: expected {len(dims)} dimensions {_shape_text(dims)}, "
                         f"got {_describe(t)}")
    for i, (want, have) in enumerate(zip(dims, t.shape)):
        if want is not None and want != have:
            raise ValueError(f"{name}: expected shape {_shape_text(dims)} (dimension {i} = "
                             f"{want}), got {_describe(t)}")
    if floating and t.dtype not in _FLOAT:
        raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32, "
                        f"float64), got {t.dtype}")
    if any(s == 0 for s in t.shape):
        raise ValueError(f"{name}: expected no empty dimension, got {_describe(t)}")
    return t


def _shape_text(dims) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"


def same_device(tensors: Dict[str, Optional[Tensor]]) -> torch.device:
    """All given tensors on one device; returns it."""
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} like {first_name}, "
                             f"got one on {t.device}")
    return first.device


def same_dtype(tensors: Dict[str, Tensor]) -> torch.dtype:
    """The inputs that meet in one product (q, k, v) share a dtype; returns it."""
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        if tensors[name].dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} like {names[0]}, got "
                            f"{tensors[name].dtype} (mixed input dtypes are not supported)")
    return first.dtype


def scale(value, K: int) -> float:
    """``scale`` is a finite number; ``None`` gives ``K ** -0.5``."""
    if value is None:
        return K ** -0.5
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"scale: expected a number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"scale: expected a finite number, got {value!r}")
    return float(value)


def cu_seqlens(cu, B: int, T_global: int, device: torch.device) -> Optional[list]:
    """The global packed-sequence offsets as a Python list, checked."""
    if cu is None:
        return None
    if not isinstance(cu, Tensor):
        raise TypeError(f"cu_seqlens: expected a 1-D integer torch.Tensor, got "
                        f"{type(cu).__name__}")
    if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected a 1-D int32/int64 tensor, got {_describe(cu)}")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={B}")
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 offsets [0, ..., T], got "
                         f"{cu.numel()}")
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(f"cu_seqlens: expected strictly increasing offsets (every "
                             f"sequence at least one token), got {values[i - 1]} then "
                             f"{values[i]} at position {i}")
    if values[-1] != T_global:
        raise ValueError(f"cu_seqlens: expected to end at the global length {T_global} "
                         f"(T per rank x world size), got {values[-1]}")
    return values


def initial_state(state, shape: Sequence[int], device: torch.device) -> Optional[Tensor]:
    """``initial_state`` of exactly ``shape`` on ``device``."""
    if state is None:
        return None
    tensor("initial_state", state, list(shape))
    if state.device != device:
        raise ValueError(f"initial_state: expected a tensor on {device}, got {state.device}")
    return state


def group(grp) -> None:
    """``group`` is ``None`` or an initialised process group this process belongs to."""
    problem = p2p.check_group(grp)
    if problem is not None:
        raise ValueError(f"group: {problem}")


def across_ranks(grp, device: torch.device, fields: Dict[str, int]) -> None:
    """Every rank of ``grp`` passed the same ``fields``; raise on all ranks otherwise."""
    _, size = p2p.rank_and_size(grp)
    if size == 1:
        return
    import torch.distributed as dist

    sig_device = device if dist.get_backend(grp) == "nccl" else torch.device("cpu")
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=sig_device)
    everyone = [row.tolist() for row in p2p.all_gather(mine, grp)]
    for r, row in enumerate(everyone):
        for (name, _), a, b in zip(fields.items(), everyone[0], row):
            if a != b:
                raise ValueError(f"{name}: every rank must pass the same value, but rank 0 "
                                 f"has {a} and rank {r} has {b}")


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer per supported dtype, for the cross-rank signature."""
    return _DTYPE_CODE.get(dtype, 0)

"""Argument checks for every public op: clear errors before any communication or launch.

Each error names the argument and what was expected.  Checks that need other ranks (shard
lengths, shapes, dtypes, strategy) run as one small all-gather of a signature, so every rank
raises the same error together instead of some ranks hanging in a later collective.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import sp
from ..sp import agreement, p2p, phases

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    for name, t in present.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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
    """``scale`` is a finite real number (a Python or numpy scalar, or a one-element tensor
    or array that needs no gradient); ``None`` gives ``K ** -0.5``.  Booleans are refused
    (``True`` is not a scale), and so is a tensor that requires grad: the ops do not
    differentiate ``scale``, and taking its value silently would leave its ``.grad`` None."""
    if value is None:
        return K ** -0.5
    shown = value
    if isinstance(value, Tensor):
        if value.requires_grad:
            raise ValueError(f"scale: expected a number, got a tensor that requires grad "
                             f"({shown!r}); the ops do not differentiate scale: pass "
                             f"scale=float(t) (or t.detach()), or multiply q by t instead "
                             f"to learn it")
        if value.numel() != 1:
            raise ValueError(f"scale: expected a number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"scale: expected a real number, got a {value.dtype} tensor "
                             f"({shown!r})")
        value = value.item()
    elif not isinstance(value, numbers.Number) and hasattr(value, "item") and hasattr(
            value, "shape"):  # a numpy array (or the like) holding one number
        if math.prod(value.shape) != 1:
            raise ValueError(f"scale: expected a number, got an array of shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        raise ValueError(f"scale: expected a real number, got the boolean {shown!r}")
    if not isinstance(value, numbers.Real):
        raise ValueError(f"scale: expected a finite real number, got {shown!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"scale: expected a finite number, got {shown!r}")
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
    if cu.device != device and cu.device.type != "cpu":  # before reading it (meta has no data)
        raise ValueError(f"cu_seqlens: expected a tensor on {device} or the CPU, got "
                         f"{cu.device}")
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


def strategy(name) -> None:
    """``name`` is a registered sequence-parallel strategy (checked on every call, also on
    one GPU where none runs, so that a typo fails the same way everywhere)."""
    if not isinstance(name, str) or name not in sp.names():
        raise ValueError(f"strategy: expected one of {sp.names()}, got {name!r}")


def group(grp) -> None:
    """``group`` is ``None`` or an initialised process group this process belongs to."""
    p2p.rank_and_size(grp)  # raises "group: ..." (checked fully once per group)


def collective(fn):
    """Make a public op fail together: a rank whose local checks reject its arguments still
    joins the agreement all-gather (flagged as rejected) before raising, so its peers raise
    at once instead of waiting out the communication timeout (see
    :func:`forge_dist.sp.agreement.reject` for groups with agreed signatures)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs.get("group") is None:  # one rank: nobody to tell (the ops' group is
            return fn(*args, **kwargs)   # keyword-only)
        outer = getattr(_state, "depth", 0) == 0
        if outer:
            _state.exchanged = False
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as err:
            if outer and not _state.exchanged and not isinstance(
                    err, agreement.SignatureMismatch):
                agreement.reject(kwargs.get("group"))
            raise
        finally:
            _state.depth -= 1
    return wrapper


_state = threading.local()


def across_ranks(grp, device: torch.device, fields: Dict[str, object],
                 data: Optional[Dict[str, object]] = None) -> int:
    """Every rank of ``grp`` passed the same ``fields`` (and ``data``); raise on all ranks
    otherwise.  Returns the call's signature word for the state pass.

    A new signature is agreed with one all-gather; a repeated one costs no collective and
    is checked on the device through the word (:mod:`forge_dist.sp.agreement`).  Field values
    are what the user passed (ints, dtypes, strategy names, tuples of offsets), so messages
    show them as written.
    """
    _, size = p2p.rank_and_size(grp)
    _state.exchanged = True
    if size == 1:
        return 0
    phases.begin(phases.CHECK)  # a named phase edge (forge_dist.sp.phases); no with-block:
    _, word = agreement.agree(grp, device, fields, data)  # torch.compile traces this
    phases.end(phases.CHECK)
    return word


# ------------------------------------------------------------------ finite-check mode
class NonFiniteError(FloatingPointError):
    """``FORGE_DIST_CHECK_FINITE=1`` found a NaN or an infinity (raised on every rank)."""


_NONFINITE_KINDS = ("nan", "+inf", "-inf")


def check_finite_enabled() -> bool:
    """Whether ``FORGE_DIST_CHECK_FINITE`` asks for finite checks (``1``; default ``0``).

    When on, every op scans its inputs and initial state, this rank's local summary, and its
    outputs and final state, and raises :class:`NonFiniteError` on every rank naming the
    first non-finite value (stage, tensor, index, rank, global token).  It costs one scan of
    every tensor and two small all-gathers per call: a debugging aid, off by default.
    """
    raw = os.environ.get("FORGE_DIST_CHECK_FINITE", "0")
    if raw not in ("0", "1"):
        raise ValueError(f"FORGE_DIST_CHECK_FINITE: expected 0 or 1, got {raw!r}")
    return raw == "1"


def _first_nonfinite(tensors: List[Tuple[str, Optional[Tensor]]],
                     resets: Sequence[str] = ()) -> List[int]:
    """``[tensor position, flat index, kind]`` of the first non-finite value, or ``-1``s.
    In the tensors named in ``resets`` (log decays) ``-inf`` is a hard reset, not an error."""
    for pos, (name, t) in enumerate(tensors):
        if t is None or not t.is_floating_point():
            continue
        flat = t.detach().reshape(-1)
        bad = ~torch.isfinite(flat)
        if name in resets:
            bad &= flat != float("-inf")
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            x = float(flat[i])
            kind = 0 if math.isnan(x) else (1 if x > 0 else 2)
            return [pos, i, kind]
    return [-1, -1, -1]


def finite(stage: str, tensors: List[Tuple[str, Optional[Tensor]]], grp, device: torch.device,
           *, token_tensors: Sequence[str] = (), resets: Sequence[str] = ()) -> None:
    """Raise :class:`NonFiniteError` on every rank of ``grp`` if any rank's ``tensors`` hold a
    non-finite value; the message names the lowest such rank's first one.

    ``tensors`` are ``(name, tensor or None)`` in the same order on every rank; those named
    in ``token_tensors`` have the token axis at dim 1 (rank r holds global tokens
    ``[r * T, (r + 1) * T)``), so the message also gives the global token.
    """
    rank, size = p2p.rank_and_size(grp)
    mine = _first_nonfinite(tensors, resets)
    rows = [[rank] + mine]
    if size > 1:
        sig_device = device if dist.get_backend(grp) == "nccl" else torch.device("cpu")
        gathered = p2p.all_gather(torch.tensor([rank] + mine, dtype=torch.int64,
                                               device=sig_device), grp,
                                  f"the finite checks of {stage} (FORGE_DIST_CHECK_FINITE)")
        rows = [row.tolist() for row in gathered]
    for r, pos, flat, kind in rows:
        if pos < 0:
            continue
        name, t = tensors[pos]
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(t.shape)))
        where = ""
        if name in token_tensors and t.dim() >= 2:
            where = f" (global token {r * t.shape[1] + index[1]})"
        raise NonFiniteError(
            f"FORGE_DIST_CHECK_FINITE: non-finite value ({_NONFINITE_KINDS[kind]}) in {stage} "
            f"{name!r} at index {index} of shape {tuple(t.shape)} on rank {r}{where}"
            + ("" if r == rank else f" (reported on rank {rank})"))

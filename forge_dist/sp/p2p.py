"""Point-to-point and collective helpers over ``torch.distributed`` with bounded waits.

Every wait here is bounded by :func:`timeout_seconds` (env ``FORGE_DIST_TIMEOUT``, default
60 s); a peer that never arrives raises :class:`StatePassTimeout` naming both ranks and what
was awaited, instead of hanging the job.
"""
from __future__ import annotations

import datetime
import os
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_DEFAULT_TIMEOUT_S = 60.0


class StatePassTimeout(RuntimeError):
    """A rank waited longer than the configured bound for a peer's state or gradient."""


def timeout_seconds() -> float:
    """The bound on every wait, from ``FORGE_DIST_TIMEOUT`` (seconds, default 60)."""
    raw = os.environ.get("FORGE_DIST_TIMEOUT")
    if raw is None:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FORGE_DIST_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"FORGE_DIST_TIMEOUT must be positive, got {value}")
    return value


def rank_and_size(group) -> tuple[int, int]:
    """``(rank in group, group size)``; ``(0, 1)`` when ``group`` is ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def _wait(work, group, peer: int, what: str) -> None:
    bound = timeout_seconds()
    try:
        if dist.get_backend(group) == "gloo":
            ok = work.wait(timeout=datetime.timedelta(seconds=bound))
        else:  # NCCL waits are enqueued on the stream; its watchdog bounds them.
            ok = work.wait()
    except RuntimeError as err:  # gloo reports its timeout as a RuntimeError
        raise StatePassTimeout(f"{_waiting(group, peer, what, bound)} (set FORGE_DIST_TIMEOUT "
                               f"to change the bound): {err}") from err
    if ok is False:
        raise StatePassTimeout(_waiting(group, peer, what, bound))


def _waiting(group, peer: int, what: str, bound: float) -> str:
    source = "the other ranks" if peer < 0 else f"rank {peer}"
    return f"rank {dist.get_rank(group)} gave up after {bound:g}s waiting for {what} from {source}"


def recv(shape, dtype, device, peer: int, group, what: str) -> Tensor:
    """Receive a tensor from ``peer`` (a rank of ``group``), bounded."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    work = dist.irecv(buf, src=_global(group, peer), group=group)
    _wait(work, group, peer, what)
    return buf


def irecv(buf: Tensor, peer: int, group):
    """Post a receive into ``buf``; wait on it with :func:`wait`."""
    return dist.irecv(buf, src=_global(group, peer), group=group)


def isend(tensor: Tensor, peer: int, group):
    """Start sending ``tensor`` (made contiguous) to ``peer``; returns the work handle."""
    return dist.isend(tensor.contiguous(), dst=_global(group, peer), group=group)


def wait(work, group, peer: int, what: str) -> None:
    """Bounded wait on a handle from :func:`irecv` or :func:`isend`."""
    _wait(work, group, peer, what)


def all_gather(tensor: Tensor, group) -> List[Tensor]:
    """All-gather equally shaped tensors; returns one per rank, in rank order."""
    _, size = rank_and_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    work = dist.all_gather(out, tensor.contiguous(), group=group, async_op=True)
    _wait(work, group, -1, "an all-gather")
    return out


def check_group(group) -> Optional[str]:
    """A description of what is wrong with ``group``, or ``None`` when it is usable."""
    if group is None:
        return None
    if not dist.is_available():
        return "torch.distributed is not available in this build of PyTorch"
    if not dist.is_initialized():
        return "torch.distributed is not initialised (call init_process_group first)"
    if not isinstance(group, dist.ProcessGroup):
        return f"expected a torch.distributed.ProcessGroup, got {type(group).__name__}"
    try:
        dist.get_rank(group)
    except Exception as err:  # noqa: BLE001 - report whatever the backend says
        return f"this process is not a member of the group ({err})"
    return None

"""Point-to-point and collective helpers over ``torch.distributed`` with bounded waits.

Every wait here is bounded by :func:`timeout_seconds` (env ``FORGE_DIST_TIMEOUT``, default
60 s); a peer that never arrives raises :class:`StatePassTimeout` naming both ranks and what
was awaited, instead of hanging the job.
"""
from __future__ import annotations

import datetime
import os
import time
import weakref
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


# group -> (rank, size): a checked group's ranks never change.  Weak: a module-level
# reference would keep a destroyed group alive until the interpreter exits, where gloo's
# teardown aborts the process.
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rank_and_size(group) -> tuple[int, int]:
    """``(rank in group, group size)``; ``(0, 1)`` when ``group`` is ``None``.

    The full check of :func:`check_group` runs once per group (and again after the default
    group was torn down); later calls are a dictionary look-up, since a steady-state call
    asks several times."""
    if group is None:
        return 0, 1
    known = _CHECKED.get(group) if isinstance(group, dist.ProcessGroup) else None
    if known is not None and dist.is_initialized():
        return known
    problem = check_group(group)  # e.g. a layer's halo exchange, before any op checks
    if problem is not None:
        raise ValueError(f"group: {problem}")
    known = _CHECKED[group] = (dist.get_rank(group), dist.get_world_size(group))
    return known


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def _wait(work, group, peer: int, what: str) -> None:
    bound = timeout_seconds()
    start = time.monotonic()
    try:
        if dist.get_backend(group) == "gloo":
            ok = work.wait(timeout=datetime.timedelta(seconds=bound))
        else:  # NCCL waits are enqueued on the stream; its watchdog bounds them.
            ok = work.wait()
    except RuntimeError as err:  # gloo reports its timeout (and a lost peer) as a RuntimeError
        elapsed = time.monotonic() - start
        if elapsed < 0.9 * bound:  # not the bound: the connection failed (peer crashed / left)
            raise StatePassTimeout(f"{_lost(group, peer, what, elapsed)}: {err}") from err
        raise StatePassTimeout(f"{_waiting(group, peer, what, bound)} (set FORGE_DIST_TIMEOUT "
                               f"to change the bound): {err}") from err
    if ok is False:
        raise StatePassTimeout(_waiting(group, peer, what, bound))


def _source(peer: int) -> str:
    return "the other ranks" if peer < 0 else f"rank {peer}"


def _waiting(group, peer: int, what: str, bound: float) -> str:
    msg = f"rank {dist.get_rank(group)} gave up after {bound:g}s waiting for {what} from " \
          f"{_source(peer)}"
    if peer < 0:  # a collective: say why a rank may be missing
        msg += (" (every rank must make the same op calls in the same order; a rank that "
                "raised earlier, crashed or stalled leaves the others waiting here)")
    return msg


def _lost(group, peer: int, what: str, elapsed: float) -> str:
    return (f"rank {dist.get_rank(group)} lost the connection to {_source(peer)} after "
            f"{elapsed:.2f}s waiting for {what} (the peer crashed or left the group; tear the "
            f"process group down before using it again)")


def _start(op, tensor: Tensor, peer: int, group, what: str):
    """Post ``op`` (``dist.isend``/``dist.irecv``); a peer already gone raises here."""
    start = time.monotonic()
    try:
        return op(tensor, _global(group, peer), group=group)
    except RuntimeError as err:
        raise StatePassTimeout(f"{_lost(group, peer, what, time.monotonic() - start)}: "
                               f"{err}") from err


def recv(shape, dtype, device, peer: int, group, what: str) -> Tensor:
    """Receive a tensor from ``peer`` (a rank of ``group``), bounded."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    work = _start(dist.irecv, buf, peer, group, what)
    _wait(work, group, peer, what)
    return buf


def irecv(buf: Tensor, peer: int, group, what: str = "a tensor"):
    """Post a receive into ``buf``; wait on it with :func:`wait`."""
    return _start(dist.irecv, buf, peer, group, what)


def isend(tensor: Tensor, peer: int, group, what: str = "a tensor"):
    """Start sending ``tensor`` (made contiguous) to ``peer``; returns the work handle."""
    return _start(dist.isend, tensor.contiguous(), peer, group, f"the send of {what}")


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


def barrier(group) -> None:
    """A bounded barrier over ``group``."""
    work = dist.barrier(group=group, async_op=True)
    _wait(work, group, -1, "a barrier")


def all_gather_object(obj, group) -> list:
    """All-gather picklable objects (small; for error messages), one per rank."""
    _, size = rank_and_size(group)
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def check_group(group) -> Optional[str]:
    """A description of what is wrong with ``group``, or ``None`` when it is usable."""
    if group is None:
        return None
    if not dist.is_available():
        return "torch.distributed is not available in this build of PyTorch"
    if not dist.is_initialized():
        return "torch.distributed is not initialised (call init_process_group first)"
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives non-members
        return ("this process is not a member of the group (torch.distributed.new_group "
                "returned GroupMember.NON_GROUP_MEMBER here)")
    if not isinstance(group, dist.ProcessGroup):
        return f"expected a torch.distributed.ProcessGroup, got {type(group).__name__}"
    try:
        dist.get_rank(group)
    except Exception as err:  # noqa: BLE001 - report whatever the backend says
        return f"this process is not a member of the group ({err})"
    return None

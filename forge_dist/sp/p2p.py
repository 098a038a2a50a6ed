"""Point-to-point and collective helpers over ``torch.distributed`` with bounded waits.

Every wait here is bounded by :func:`timeout_seconds` (env ``FORGE_DIST_TIMEOUT``, default
60 s); a peer that never arrives raises :class:`StatePassTimeout` naming both ranks and what
was awaited, instead of hanging the job.

A collective (all-gather, barrier) has no single peer to blame, so after one fails this rank
finds out which rank is missing through the group's store (:class:`_Roster`): every rank
wrote its process there once, when it first used the group, and the ranks that saw the
collective fail write a roll-call key.  A rank whose process has exited, or that never
reported at the collective, is the one named.  Nothing of this runs, and no store key is
touched, while collectives succeed (only the group's first one reads the roster once).
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

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
# group -> its _Roster (None where the group has no usable store); weak for the same reason
_ROSTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    if known[1] > 1 and group not in _ROSTERS:
        _ROSTERS[group] = _Roster.enrol(group, *known)
    return known


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def _wait(work, group, peer: int, what: str, collective: Optional[int] = None,
          diagnose: bool = True) -> None:
    """Wait on ``work`` within the bound.  ``peer`` < 0 means a collective, the
    ``collective``-th of this group on this rank: when it fails, the missing rank is looked
    up (unless ``diagnose`` is false: a caller that drops the error anyway)."""
    bound = timeout_seconds()
    start = time.monotonic()
    try:
        if dist.get_backend(group) == "gloo":
            ok = work.wait(timeout=datetime.timedelta(seconds=bound))
        else:  # NCCL waits are enqueued on the stream; its watchdog bounds them.
            ok = work.wait()
    except RuntimeError as err:  # gloo reports its timeout (and a lost peer) as a RuntimeError
        elapsed = time.monotonic() - start
        lost = elapsed < 0.9 * bound  # not the bound: the connection failed (crashed / left)
        msg = _failed(group, peer, what, lost, elapsed if lost else bound, collective, diagnose)
        raise StatePassTimeout(f"{msg}: {err}") from err
    if ok is False:
        raise StatePassTimeout(_failed(group, peer, what, False, bound, collective, diagnose))
    if collective == 1:  # every rank has enrolled by now: read their processes, once
        roster = _ROSTERS.get(group)
        if roster is not None:
            roster.read_processes()


def _failed(group, peer: int, what: str, lost: bool, elapsed: float,
            collective: Optional[int] = None, diagnose: bool = True) -> str:
    """The message of a failed transfer: who is missing (for a collective, the rank the
    group's store points at, see :class:`_Roster`), what was awaited, and what to do."""
    source, note = _source(peer), ""
    if peer < 0 and diagnose:
        roster = _ROSTERS.get(group)
        if roster is None or collective is None:
            note = " (could not tell which rank is missing: the group has no usable store)"
        else:
            source, note = roster.diagnose(collective, what, timeout_seconds())
    me = dist.get_rank(group)
    if source == "the other ranks":  # say why a rank may be missing from a collective
        note += (" (every rank must make the same op calls in the same order; a rank that "
                 "raised earlier, crashed or stalled leaves the others waiting here)")
    if lost:
        return (f"rank {me} lost the connection to {source} after {elapsed:.2f}s waiting for "
                f"{what}{note} (the peer crashed or left the group; tear the process group "
                f"down before using it again)")
    return (f"rank {me} gave up after {elapsed:g}s waiting for {what} from {source}{note} "
            f"(set FORGE_DIST_TIMEOUT to change the bound)")


def _source(peer: int) -> str:
    return "the other ranks" if peer < 0 else f"rank {peer}"


def _start(op, tensor: Tensor, peer: int, group, what: str):
    """Post ``op`` (``dist.isend``/``dist.irecv``); a peer already gone raises here."""
    start = time.monotonic()
    try:
        return op(tensor, _global(group, peer), group=group)
    except RuntimeError as err:
        msg = _failed(group, peer, what, True, time.monotonic() - start)
        raise StatePassTimeout(f"{msg}: {err}") from err


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


def exchange(send: Optional[Tensor], dst: int, recv_buf: Optional[Tensor], src: int, group,
             what: str) -> None:
    """Send ``send`` to ``dst`` while receiving into ``recv_buf`` from ``src`` (either may be
    ``None``), bounded.  Both are posted as one batch (one NCCL group), so a rank's send
    never waits behind its own receive: in a round where every rank both receives and
    sends, separate calls would queue them on one stream and chain the ranks."""
    ops, peers = [], []
    if recv_buf is not None:
        ops.append(dist.P2POp(dist.irecv, recv_buf, _global(group, src), group))
        peers.append((src, what))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), _global(group, dst), group))
        peers.append((dst, f"the send of {what}"))
    if not ops:
        return
    start = time.monotonic()
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as err:
        peer, w_what = peers[0]
        msg = _failed(group, peer, w_what, True, time.monotonic() - start)
        raise StatePassTimeout(f"{msg}: {err}") from err
    for work, (peer, w_what) in zip(works, peers):
        _wait(work, group, peer, w_what)


def _collective(post, group, what: str, diagnose: bool) -> None:
    """Run one collective (``post()`` returns its work handle), bounded; a failure names the
    missing rank.  Its number on this group (the same on every rank, since every rank makes
    the same collectives in the same order) keys the roll call after a failure."""
    roster = _ROSTERS.get(group)
    n = None
    if roster is not None:
        n = roster.collectives = roster.collectives + 1
    start = time.monotonic()
    try:
        work = post()
    except RuntimeError as err:  # a peer already gone can fail the post itself
        msg = _failed(group, -1, what, True, time.monotonic() - start, n, diagnose)
        raise StatePassTimeout(f"{msg}: {err}") from err
    _wait(work, group, -1, what, n, diagnose)


def all_gather(tensor: Tensor, group, what: str = "an all-gather",
               diagnose: bool = True) -> List[Tensor]:
    """All-gather equally shaped tensors; returns one per rank, in rank order.  ``what``
    (e.g. "the state gradients (lasp2 all-gather)") is what a failure's message says was
    being exchanged."""
    _, size = rank_and_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    tensor = tensor.contiguous()
    _collective(lambda: dist.all_gather(out, tensor, group=group, async_op=True), group, what,
                diagnose)
    return out


def barrier(group, what: str = "a barrier") -> None:
    """A bounded barrier over ``group``."""
    rank_and_size(group)
    _collective(lambda: dist.barrier(group=group, async_op=True), group, what, True)


def all_gather_object(obj, group, what: str = "objects") -> list:
    """All-gather picklable objects (small; for error messages), one per rank.

    Two bounded all-gathers (the pickles' lengths, then the padded pickles), unlike
    ``torch.distributed.all_gather_object``, whose wait is the group's own timeout (30
    minutes by default) and whose failure names no rank."""
    rank_and_size(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    data = pickle.dumps(obj)
    lengths = [int(n) for n in all_gather(torch.tensor([len(data)], device=device), group,
                                          f"the sizes of {what}")]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_gather(buf.to(device), group, what)
    return [pickle.loads(row[:n].cpu().numpy().tobytes()) for row, n in zip(rows, lengths)]


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


# ------------------------------------------------------------------ naming a missing rank
_KEY = "forge_dist/roster"
_POLL_S = 0.05
_STORE_SLACK_S = 5.0  # beyond the roll call, how long a store that stopped answering may take
_EARLY_READ_MAX = 64  # groups up to this size read their processes after the first collective


def _roll_call_s(bound: float) -> float:
    """How long a rank waits for its peers to report a failed collective: those that were
    in it fail at about the same time (at once after a crash, at the bound after a stall)."""
    return min(bound, max(1.0, 0.1 * bound))


def _proc_stat(pid: int) -> Optional[Tuple[str, str]]:
    """``(state, start time)`` of a process from ``/proc`` (Linux), ``None`` if it is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
    return fields[0], fields[19]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _this_machine() -> str:
    """Where a pid means the same process: the host, its boot and the pid namespace."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{_read('/proc/sys/kernel/random/boot_id')}|{ns}"


def _this_process() -> Dict[str, object]:
    try:
        start = _proc_stat(os.getpid())[1]
    except OSError:
        start = None
    return {"machine": _this_machine(), "pid": os.getpid(), "start": start}


def _exited(info: Optional[dict]) -> Optional[bool]:
    """Whether the process ``info`` describes has exited (a zombie counts), or ``None``
    when this rank cannot tell (another machine, or nothing published)."""
    if not info or info.get("machine") != _this_machine():
        return None
    pid = int(info["pid"])
    try:
        state, start = _proc_stat(pid)
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return state in ("Z", "X", "x") or (info.get("start") is not None
                                        and start != info["start"])  # the pid was reused


def _ranks(ranks: List[int]) -> str:
    """``rank 2`` / ``ranks 1 and 2`` / ``ranks 1, 3 and 4`` (the first 8, then a count)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = [str(r) for r in ranks[:8]]
    tail = f" ({len(ranks)} ranks)" if len(ranks) > 8 else ""
    return f"ranks {', '.join(shown[:-1])} and {shown[-1]}{tail}"


class _Roster:
    """What a group's store knows of its ranks, to name the one missing from a collective.

    At enrolment (the group's first use on this rank) the rank adds its process (machine,
    pid, start time) to the group's list of processes, one store key that every rank
    appends to; after the group's first collective succeeds every rank has done so, and the
    list is read once (in groups of up to ``_EARLY_READ_MAX`` ranks; larger ones read it
    after a failure).  That is all the store traffic of a healthy group: a steady-state call
    touches no key.  After a failed collective the rank appends itself to that collective's
    roll call (another single key) and looks for the culprit: a peer whose process has
    exited (on this machine), else the peers missing from the roll call after a short wait.
    Single keys keep a failure's traffic to a request or two per poll however large the
    group.  All store use is best effort, in a daemon thread with a bounded join, so a store
    that is gone too (e.g. hosted by the dead rank) only makes the message less precise."""

    def __init__(self, store, rank: int, size: int, epoch: int):
        self.store, self.rank, self.size, self.epoch = store, rank, size, epoch
        self.collectives = 0  # bounded collectives made on the group by this rank
        self.procs: Optional[Dict[int, dict]] = None

    def key(self, *parts) -> str:
        # the epoch: a store that outlives the group (re-initialised on the same store)
        # must not show the previous incarnation's processes or roll calls
        return "/".join([_KEY, str(self.epoch)] + [str(p) for p in parts])

    @classmethod
    def enrol(cls, group, rank: int, size: int) -> Optional["_Roster"]:
        try:
            from torch.distributed import distributed_c10d  # optional: private c10d API

            store = distributed_c10d._get_process_group_store(group)
            epoch = store.add(f"{_KEY}/epoch/{rank}", 1)
            roster = cls(store, rank, size, epoch)
            store.append(roster.key("procs"), json.dumps({"rank": rank, **_this_process()})
                         + "\n")
            return roster
        except Exception:  # noqa: BLE001 - no store (or not reachable): no names, no harm
            return None

    def _processes(self, store) -> Dict[int, dict]:
        key = self.key("procs")
        if not store.check([key]):  # a get of a missing key would block
            return {}
        procs = {}
        for line in store.get(key).decode().splitlines():
            info = json.loads(line)
            procs[int(info.pop("rank"))] = info
        return procs

    def read_processes(self) -> None:
        """Read the peers' processes (once): every rank enrolled before joining the group's
        first collective, so after it succeeds they are listed, and later the store may be
        gone (its host may be the rank that died)."""
        if self.procs is not None:
            return
        self.procs = {}
        if self.size > _EARLY_READ_MAX:  # every rank reading every rank: left to a failure
            return
        try:
            self.procs = self._processes(self.store)
        except Exception:  # noqa: BLE001 - best effort: read again after a failure
            pass

    def diagnose(self, collective: int, what: str, bound: float) -> Tuple[str, str]:
        """``(source, note)`` for a failed collective's message: the missing rank(s), as
        ``"rank 2"``, and why they are named."""
        result: List[Tuple[str, str]] = []
        wait_s = _roll_call_s(bound)
        worker = threading.Thread(target=lambda: result.append(self._find(collective, wait_s)),
                                  name="forge_dist roll call", daemon=True)
        worker.start()
        worker.join(wait_s + _STORE_SLACK_S)
        if not result:
            return "the other ranks", " (could not tell which rank is missing: the store " \
                                      "did not answer)"
        return result[0]

    def _find(self, collective: int, wait_s: float) -> Tuple[str, str]:
        try:
            store = self.store.clone()  # its own connection and timeout
            store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
        except Exception:  # noqa: BLE001 - a store that cannot be cloned: the bounded join
            store = self.store
        others = [r for r in range(self.size) if r != self.rank]
        procs = dict(self.procs or {})
        roll = self.key("roll", collective)
        poll_s = min(1.0, _POLL_S * max(1.0, self.size / 64))  # a large group: fewer polls
        store_error = None
        try:
            store.append(roll, f"{self.rank} ")
        except Exception as err:  # noqa: BLE001
            store_error = err
        deadline = time.monotonic() + wait_s
        reported: List[int] = []
        while True:
            if store_error is None:
                try:
                    if any(r not in procs for r in others):  # not read yet
                        procs.update(self._processes(store))
                    present = {int(r) for r in store.get(roll).decode().split()}
                    reported = [r for r in others if r in present]
                except Exception as err:  # noqa: BLE001
                    store_error = err
            dead = [r for r in others if r not in reported and _exited(procs.get(r))]
            if dead:  # the others are most likely held up behind these
                return _ranks(dead), _died(dead, procs)
            if store_error is not None or len(reported) == len(others) \
                    or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        if store_error is not None:
            return "the other ranks", (f" (could not tell which rank is missing: the group's "
                                       f"store failed too, {type(store_error).__name__}: "
                                       f"{store_error})")
        absent = [r for r in others if r not in reported]
        if not absent:
            return "the other ranks", (f" ({_ranks(reported)} failed in this collective too, so "
                                       f"none is missing from it: this rank may have come late, "
                                       f"after they gave up; see their errors)")
        one = len(absent) == 1
        it, are = ("it", "is") if one else ("they", "are")
        if all(_exited(procs.get(r)) is False for r in absent):
            why = (f"{are} alive but did not reach this collective: {it} raised earlier, "
                   f"stalled or {are} making other calls")
        else:
            why = (f"did not reach this collective, or report a failure in it within "
                   f"{wait_s:g}s: {it} died, stalled or {are} making other calls")
        return _ranks(absent), f" ({_ranks(absent)} {why})"


def _died(dead: List[int], procs: Dict[int, dict]) -> str:
    pids = ", ".join(str(procs[r]["pid"]) for r in dead)
    if len(dead) == 1:
        return f" ({_ranks(dead)} died: its process, pid {pids} on this machine, has exited)"
    return f" ({_ranks(dead)} died: their processes, pids {pids} on this machine, have exited)"

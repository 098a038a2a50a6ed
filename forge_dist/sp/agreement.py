"""Cross-rank argument agreement: on the host once per new signature, then on the device.

Every rank of a sequence-parallel call must pass the same kind of arguments (shapes, dtype,
strategy, packing).  Checking that with a host all-gather on every call costs a collective and
a host synchronisation per call, which made a steady-state call host-bound.  Instead:

1. **A new signature** (the tuple of a call's fields, e.g. ``B``, ``T``, ``H``, dtype,
   strategy) is agreed once per group with one all-gather of a fixed-length row of words.  A
   mismatch raises the same error on every rank, naming the argument with the values as the
   user wrote them (``torch.bfloat16``, ``'lasp2'``, the first differing offset).
2. **A repeated signature** needs no collective.  The call's *signature word* (60 bits: the
   agreed fields plus a hash of the data-dependent ones such as the packed offsets) travels
   with the state, as a trailer of every passed state tile (:func:`trailer`).  A receiving rank
   whose own word differs poisons what it received with NaN and sets a device error flag
   (:class:`DeviceFlag`), which the next call, or :func:`forge_dist.sp.flush`, turns into an
   error naming the peer and, where this rank knows the peer's signature, the argument.

So no call ever returns a wrong result silently, and no steady-state call touches the host.
"""
from __future__ import annotations

import hashlib
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.channel import SignatureMismatch  # raised here and by the channels alike
from . import p2p

ROW_LEN = 32  # words per rank in the agreement all-gather (fixed: ranks calling other ops
#               must still pair up and get a clear error instead of a size mismatch)
REJECTED = -1  # first word of a rank whose own arguments failed their local checks
TRAILER = 4    # elements appended to a passed state: three 20-bit chunks of the word, a zero
_CHUNK_BITS = 20
_WORD_MASK = (1 << 60) - 1
_TABLE_SIZE = 256  # agreed signatures kept per group (least recently used dropped)

ERR_SIGNATURE = 5  # device error code: a peer's signature word differs from this rank's
ERR_UPSTREAM = 6   # a peer forwarded a state it had poisoned (a mismatch further up)




def _stable_hash(data: bytes) -> int:
    """A 60-bit hash that is the same in every process (``hash()`` of str is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _WORD_MASK


_KNOWN: Dict[int, object] = {}  # word -> value, for the values a peer may have passed
_SEEDED = False


def _encode(value) -> int:
    """One signed 64-bit word per field value (ints as themselves, anything else hashed;
    the hashes of values this rank passed or knows of decode back in messages)."""
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 62) <= value < (1 << 62):
        return value
    word = _stable_hash(repr(value).encode()) | (1 << 62)  # apart from small ints
    if len(_KNOWN) < 4096:
        _KNOWN.setdefault(word, value)
    return word


def _decode(word: int):
    """A peer's field value from its word, where this rank can tell (else ``None``)."""
    if -(1 << 62) <= word < (1 << 62):
        return word
    global _SEEDED
    if not _SEEDED:
        # lazy: the sp package imports this module before it defines names
        from . import names  # every strategy name and dtype: what peers pass
        for value in list(names()) + list(GATE_NAMES.values()) + [
                getattr(torch, n) for n in dir(torch)
                if isinstance(getattr(torch, n, None), torch.dtype)]:
            _encode(value)
        _SEEDED = True
    return _KNOWN.get(word)


def _show(value) -> str:
    """A field value as the user wrote it (``torch.bfloat16``, ``'lasp2'``, ``4096``)."""
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(map(str, value[:8]))}, ... {len(value)} values)"
    return repr(value) if isinstance(value, str) else str(value)


@dataclass
class Signature:
    """One agreed signature: the fields as passed and its 60-bit word."""

    fields: Dict[str, object]
    word: int


def chunks(word: int) -> List[int]:
    """The word as three integers below 2**20 (exact in fp32, fp64 and bf16-free paths)."""
    mask = (1 << _CHUNK_BITS) - 1
    return [(word >> (_CHUNK_BITS * i)) & mask for i in range(3)]


def unchunk(values) -> int:
    return sum(int(v) << (_CHUNK_BITS * i) for i, v in enumerate(values))


def call_word(sig: Signature, data: Dict[str, object]) -> int:
    """The word of one call: the agreed signature's, mixed with the data-dependent fields
    (e.g. the packed offsets) that are compared on the device only."""
    if not data:
        return sig.word
    blob = repr((sig.word, sorted(data.items()))).encode()
    return _stable_hash(blob)


class _GroupTable:
    """Agreed signatures of one group, most recently used last, and the words this rank
    has sent with each (to explain a peer's word in an error)."""

    def __init__(self):
        self.agreed: "OrderedDict[tuple, Signature]" = OrderedDict()
        self.by_word: Dict[int, Tuple[Signature, Dict[str, object]]] = {}

    def remember_word(self, word: int, sig: Signature, data: Dict[str, object]) -> None:
        if word not in self.by_word:
            if len(self.by_word) >= 4 * _TABLE_SIZE:
                self.by_word.pop(next(iter(self.by_word)))
            self.by_word[word] = (sig, data)


_TABLES: Dict[object, _GroupTable] = {}
_LOCK = threading.Lock()


def group_key(group) -> object:
    """A key that names ``group`` in this process (its name, else its identity)."""
    return getattr(group, "group_name", None) or id(group)


def _table(group) -> _GroupTable:
    key = group_key(group)
    table = _TABLES.get(key)
    if table is None:
        with _LOCK:
            table = _TABLES.setdefault(key, _GroupTable())
    return table


def forget(group=None) -> None:
    """Drop the agreed signatures (of ``group``, or all): the next call agrees anew.

    Call it on every rank together, e.g. after rebuilding a group that failed."""
    name = None if group is None else group_key(group)
    for key in list(_TABLES):
        if name is None or key == name:
            del _TABLES[key]
    for key in list(_FLAGS):
        if name is None or key[0] == name:
            del _FLAGS[key]  # a pending record belongs to the calls before the reset


def signature_device(group, device: torch.device) -> torch.device:
    """Where this group's host agreements put their tensors (NCCL: the GPU; else the CPU)."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def agree(group, device: torch.device, fields: Dict[str, object],
          data: Optional[Dict[str, object]] = None) -> Tuple[Signature, int]:
    """Every rank of ``group`` passed the same ``fields`` (and ``data``); returns the agreed
    :class:`Signature` and this call's word.

    ``fields`` are compared on the host the first time this signature is seen (one
    all-gather, every rank raising the same :class:`SignatureMismatch`), then only on the
    device through the word.  ``data`` (values that may change every call, such as the
    packed offsets) never makes a new signature: it is compared on the host together with a
    new signature's fields, and on the device always.
    """
    data = data or {}
    table = _table(group)
    key = tuple(fields.items())
    sig = table.agreed.get(key)
    if sig is None:
        sig = _agree_on_host(group, device, fields, data)
        table.agreed[key] = sig
        if len(table.agreed) > _TABLE_SIZE:
            table.agreed.popitem(last=False)
    else:
        table.agreed.move_to_end(key)
    word = call_word(sig, data)
    table.remember_word(word, sig, data)
    return sig, word


#: gate_flags of the ops -> what the signature calls their gate inputs
GATE_NAMES = {0: "none", 1: "g", 2: "g (per channel)", 3: "g, beta", 4: "beta", 5: "g"}


def op_fields(op: str, *, B: int, T: int, dims: Dict[str, int], dtype: torch.dtype,
              strategy: str, gates: str, offsets: int, grad: bool) -> Dict[str, object]:
    """The fields every rank of one op call must agree on, built the same way by every path
    that runs sequence-parallel calls (the runner, plans, the DSL), so that one rank taking
    a plan and another the runner still send the same signature word.  ``strategy`` is the
    resolved name, ``offsets`` the number of ``cu_seqlens`` offsets (0 without)."""
    fields: Dict[str, object] = {"B": B, "T (tokens per rank)": T}
    fields.update(dims)
    # the op last: simple_gla without gates runs as linear_attn, and "gates given" is what
    # the user sees differ then
    fields.update({"dtype": dtype, "strategy": strategy, "gates given": gates,
                   "cu_seqlens (number of offsets)": offsets,
                   "requires_grad (of any input, with grad mode on)": grad, "op": op})
    return fields


def _row(fields: Dict[str, object], data: Dict[str, object]) -> List[int]:
    names = list(fields) + list(data)
    if len(names) > ROW_LEN - 1:
        raise AssertionError(f"agree: at most {ROW_LEN - 1} fields")
    layout = zlib.crc32("|".join(names).encode())
    values = [layout] + [_encode(v) for v in fields.values()] + [_encode(v)
                                                               for v in data.values()]
    return values + [0] * (ROW_LEN - len(values))


#: what the agreement all-gather exchanges, as its failure's message says
_EXCHANGE = "the call signatures (the argument agreement of a new signature)"


def _agree_on_host(group, device, fields, data) -> Signature:
    rank, size = p2p.rank_and_size(group)
    word = _stable_hash(repr(tuple((k, _encode(v)) for k, v in fields.items())).encode())
    sig = Signature(dict(fields), word)
    if size == 1:
        return sig
    row = torch.tensor(_row(fields, data), dtype=torch.int64,
                       device=signature_device(group, device))
    everyone = [r.tolist() for r in p2p.all_gather(row, group, _EXCHANGE)]
    for r, other in enumerate(everyone):
        if other[0] == REJECTED:
            raise SignatureMismatch(f"rank {r} rejected its own arguments (its error names "
                                    f"the argument); no rank ran the op")
    names = list(fields) + list(data)
    for r, other in enumerate(everyone):
        if other[0] != everyone[0][0]:
            raise SignatureMismatch(
                f"every rank must call the same op with the same kind of arguments, but "
                f"rank 0 and rank {r} called ops with different arguments (this rank passed "
                f"{', '.join(names)})")
    values = list(fields.values()) + list(data.values())
    for r, other in enumerate(everyone):
        for i, name in enumerate(names):
            if everyone[0][1 + i] != other[1 + i]:
                raise SignatureMismatch(_mismatch_message(
                    group, name, values[i], rank, r, everyone[0][1 + i], other[1 + i]))
    return sig


def _mismatch_message(group, name: str, mine, rank: int, other_rank: int, first_word: int,
                      other_word: int) -> str:
    """Name the argument and show rank 0's and ``other_rank``'s values as written.  Every
    rank reaches this together (they all saw the same gathered rows); only offsets, which no
    word can show, are gathered once more to name the first that differs."""
    if isinstance(mine, tuple):
        everyone = p2p.all_gather_object(mine, group, f"every rank's {name}")
        first, theirs = everyone[0], everyone[other_rank]
    else:
        first = mine if rank == 0 else _decode(first_word)
        theirs = mine if rank == other_rank else _decode(other_word)
    if isinstance(first, tuple) and isinstance(theirs, tuple):
        for i, (a, b) in enumerate(zip(first, theirs)):
            if a != b:
                return (f"{name}: every rank must pass the same values, but rank 0 and rank "
                        f"{other_rank} differ first at position {i}: rank 0 has {a} and "
                        f"rank {other_rank} has {b}")
        return (f"{name}: every rank must pass the same values, but rank 0 passes "
                f"{len(first)} and rank {other_rank} passes {len(theirs)}")
    shown = [("another value" if v is None else _show(v)) for v in (first, theirs)]
    return (f"{name}: every rank must pass the same value, but rank 0 has {shown[0]} and "
            f"rank {other_rank} has {shown[1]}")


def reject(group, device: Optional[torch.device] = None) -> None:
    """This rank's own arguments failed: tell the peers through the agreement all-gather.

    Only a group with no agreed signature yet is sure to have its peers in that all-gather;
    on a group with agreed signatures, peers whose call repeats one make no collective, and
    they learn of the failure through their bounded state-pass wait instead."""
    if p2p.check_group(group) is not None or p2p.rank_and_size(group)[1] == 1:
        return
    if _table(group).agreed:
        return
    device = device or (torch.device("cuda", torch.cuda.current_device())
                        if torch.cuda.is_available() else torch.device("cpu"))
    row = torch.zeros(ROW_LEN, dtype=torch.int64, device=signature_device(group, device))
    row[0] = REJECTED
    try:
        p2p.all_gather(row, group, _EXCHANGE, diagnose=False)
    except p2p.StatePassTimeout:
        pass  # the peers are gone or elsewhere; the local error is what matters


def explain(group, peer: int, peer_word: int, my_word: int) -> str:
    """Why ``peer``'s word differs from this rank's, as far as this rank can tell
    (``group``: the process group or its :func:`group_key`)."""
    key = None if group is None else (group if isinstance(group, (str, int)) else
                                      group_key(group))
    table = _TABLES.get(key) if key is not None else None
    mine = theirs = None
    if table is not None:
        mine = table.by_word.get(my_word)
        theirs = table.by_word.get(peer_word)
    if mine is not None and theirs is not None:
        (msig, mdata), (tsig, tdata) = mine, theirs
        diffs = [name for name in list(msig.fields) + list(mdata)
                 if {**tsig.fields, **tdata}.get(name) != {**msig.fields, **mdata}.get(name)]
        if diffs:
            name = diffs[0]
            a = {**msig.fields, **mdata}[name]
            b = {**tsig.fields, **tdata}.get(name)
            return (f"{name}: every rank must pass the same value, but this rank has "
                    f"{_show(a)} and rank {peer} has {_show(b)}")
    if mine is not None and mine[1]:
        names = ", ".join(mine[1])
        return (f"rank {peer} passed arguments that differ from this rank's ({names} or an "
                f"argument agreed earlier); every rank must pass the same values")
    return (f"rank {peer} passed arguments that differ from this rank's; every rank must "
            f"pass the same values")


# ------------------------------------------------------------------ the device flag
class DeviceFlag:
    """A device error record ``[code, peer, detail, expected]`` (int64) set without a host
    synchronisation, read lazily: a pinned copy scheduled after each call, inspected at the
    next call (when ready) or by :func:`flush` (waiting)."""

    def __init__(self, device: torch.device, describe: Callable[[List[int]], str]):
        self.device = device
        self.err = torch.zeros(4, dtype=torch.int64, device=device)
        self.describe = describe
        self._host: Optional[Tensor] = None
        self._event = None
        self._consts: Dict[int, Tensor] = {}
        self._shifts: Optional[Tensor] = None

    def check_trailer(self, received: Tensor, mine: Tensor, peer: int) -> Tensor:
        """Compare a received trailer with this rank's; returns a 0-d bool (on the device)
        that is true when the peer's word differs or the peer forwarded a poisoned state,
        and records the first such event.  Only tensors cached here meet the data: no
        host-to-device copy, no synchronisation."""
        differs = (received[:3] != mine[:3]).any()
        upstream = received[3] != 0
        bad = differs | upstream
        code = torch.where(differs, self._const(ERR_SIGNATURE), self._const(ERR_UPSTREAM))
        record = torch.stack([code, self._const(peer), self._word_of(received),
                              self._word_of(mine)])
        fresh = bad & (self.err[0] == 0)
        self.err.copy_(torch.where(fresh, record, self.err))
        return bad

    def _last_slot(self, like: Tensor) -> Tensor:
        """A cached mask of a trailer's poison slot."""
        key = ("slot", like.dtype)
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.arange(TRAILER, device=self.device) == TRAILER - 1
        return t

    def _const(self, value: int) -> Tensor:
        t = self._consts.get(value)
        if t is None:
            t = self._consts[value] = torch.tensor(value, dtype=torch.int64, device=self.device)
        return t

    def _word_of(self, trailer: Tensor) -> Tensor:
        if self._shifts is None:
            self._shifts = torch.tensor([0, _CHUNK_BITS, 2 * _CHUNK_BITS], dtype=torch.int64,
                                        device=self.device)
        return (trailer[:3].to(torch.int64) << self._shifts).sum()

    def after_call(self) -> None:
        """Schedule the host's copy of the record (a no-op on the CPU: read directly)."""
        if self.device.type != "cuda":
            self.poll(wait=True)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        if self._host is None:
            self._host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        self._host.copy_(self.err, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._event = event

    def poll(self, wait: bool = False) -> None:
        """Raise :class:`SignatureMismatch` if a finished call recorded an error."""
        if self.device.type != "cuda":
            host = self.err
        else:
            event = self._event
            if event is None:
                if not wait:
                    return
                torch.cuda.synchronize(self.device)
                host = self.err.cpu()
            else:
                if wait:
                    event.synchronize()
                elif not event.query():
                    return
                self._event = None
                host = self._host
        values = [int(x) for x in host.tolist()]
        if values[0] == 0:
            return
        self.err.zero_()
        raise SignatureMismatch(self.describe(values))


_FLAGS: Dict[tuple, DeviceFlag] = {}


def device_flag(group, device: torch.device) -> DeviceFlag:
    """The baselines' flag for ``(group, device)``."""
    key = (group_key(group), device)
    flag = _FLAGS.get(key)
    if flag is None:
        rank = p2p.rank_and_size(group)[0]

        def describe(values, group=key[0], rank=rank):  # the key: no reference to the group
            code, peer, peer_word, word = values
            if code == ERR_UPSTREAM:
                why = (f"rank {peer} passed on a state poisoned by a signature mismatch "
                       f"further up the chain (that rank's error names the argument)")
            else:
                why = explain(group, peer, peer_word, word)
            return f"rank {rank}: {why}; this rank's output of that call is NaN"
        flag = _FLAGS[key] = DeviceFlag(device, describe)
    return flag


class Stamp:
    """One baseline call's signature trailers: append to what is sent, check what is
    received (poisoning it with NaN on a mismatch), and schedule the flag's read.

    Usage: ``stamp = Stamp(group, word, like)`` (raises a previous call's error), then
    :meth:`receive` / :meth:`send` around the transfers, then :meth:`done`."""

    def __init__(self, group, word: int, like: Tensor):
        self.flag = device_flag(group, like.device)
        self.flag.poll()
        self.mine = trailer(word, like.dtype, like.device)
        self.bad: Optional[Tensor] = None

    def receive(self, payload: Tensor, peer: int, like: Tensor) -> Tensor:
        """``payload`` = flat data + trailer; returns the data shaped like ``like`` (NaN if
        the peer's word differs)."""
        data, tail = payload[:-TRAILER].view_as(like), payload[-TRAILER:]
        bad = self.flag.check_trailer(tail, self.mine, peer)
        self.bad = bad if self.bad is None else self.bad | bad
        return data.masked_fill_(bad, float("nan"))  # in place: no state-sized copy

    def send(self, x: Tensor) -> Tensor:
        """``x`` flattened with this rank's trailer (marked poisoned if a receive was bad)."""
        tail = self.mine
        if self.bad is not None:
            tail = torch.where(self.flag._last_slot(tail), self.bad.to(tail.dtype), tail)
        return torch.cat([x.reshape(-1), tail])

    def done(self) -> None:
        self.flag.after_call()


_TRAILERS: "OrderedDict[tuple, Tensor]" = OrderedDict()


def trailer(word: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[TRAILER]`` values of ``word`` on ``device`` (cached; a new word is copied from
    pinned memory without blocking the host)."""
    key = (word, dtype, device)
    t = _TRAILERS.get(key)
    if t is None:
        host = torch.tensor(chunks(word) + [0], dtype=dtype)
        if device.type == "cuda":
            host = host.pin_memory()
        t = _TRAILERS[key] = host.to(device, non_blocking=True)
        if len(_TRAILERS) > 4 * _TABLE_SIZE:
            _TRAILERS.popitem(last=False)
    return t


def poll_flags(group=None, wait: bool = False) -> None:
    """Raise if any baseline's device flag (of ``group``, or any) holds an error."""
    name = None if group is None else group_key(group)
    for (key, _), flag in list(_FLAGS.items()):
        if name is None or key == name:
            flag.poll(wait=wait)

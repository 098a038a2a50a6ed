"""One-directional rank-to-rank tile channels over NVSHMEM or the simulated transport.

A channel carries one state per call from each rank to its neighbour in one direction
(forward: r -> r+1, backward: r -> r-1), cut into ``n_tiles`` tiles of ``tile_elems``
elements stored tile-major, so each tile is one contiguous put.  Per rank it holds:

* ``recv [n_tiles, tile_elems]`` (symmetric): where the upstream neighbour puts tiles;
* ``send [n_tiles, tile_elems]`` (symmetric): staging of outgoing tiles;
* ``sig [n_tiles]`` int64 (symmetric): data signals, ``2 * epoch (+1 if poisoned)``;
* ``ack [n_tiles]`` int64 (symmetric): credits from the downstream neighbour, ``epoch`` of
  the last call whose tile it has copied out of its ``recv`` (a producer may not overwrite
  a slot its consumer has not read: it waits ``ack >= epoch - 1`` before putting);
* ``err [6]`` int64 (local): ``[code, peer, tile, epoch, peer's word, own word]`` of the
  first failed wait or signature mismatch (the words only for the latter);
* ``counter [2]`` int64 (local): ``[epoch, programs done]``.

``epoch`` counts calls on this channel; it only grows, and it lives on the device: every
program of a call reads ``counter[0] + 1`` as its epoch, and the last program to finish
stores it back (and zeroes ``counter[1]``).  The host passes only the counter's address, so
a launch captured in a CUDA graph replays with a new epoch each time.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import NVSHMEM, SIM, nvshmem

ERR_RECV_TIMEOUT, ERR_CREDIT_TIMEOUT, ERR_UPSTREAM, ERR_AHEAD, ERR_SIGNATURE = 1, 2, 3, 4, 5
ERR_WORDS = 6  # length of the error record


def check_mode() -> str:
    """When the host reads the error flag: ``sync`` (after every kernel: a stream sync) or
    ``lazy`` (default: a non-blocking copy, read at the next call or at :func:`flush`)."""
    mode = os.environ.get("FORGE_DIST_FORGE_CHECK", "lazy")
    if mode not in ("sync", "lazy"):
        raise ValueError(f"FORGE_DIST_FORGE_CHECK must be 'sync' or 'lazy', got {mode!r}")
    return mode


class SignatureMismatch(ValueError):
    """Ranks of one sequence-parallel call passed different arguments (found by the host
    agreement, or on the device from the signature word a state tile carries)."""


def describe_error(err, rank: int, what: str, bound_s: float, explain=None) -> str:
    """The message for an error record ``[code, peer, tile, epoch, words...]`` seen on
    ``rank``; ``explain(peer, peer_word, own_word)`` names a signature mismatch's argument."""
    code, peer, tile, epoch, peer_word, own_word = (int(x) for x in err)
    if code == ERR_SIGNATURE:
        why = explain(peer, peer_word, own_word) if explain is not None else (
            f"rank {peer} passed arguments that differ from this rank's")
        return (f"rank {rank}: {why} (found on {what} tile {tile}, call {epoch}, whose "
                f"output on this rank is NaN)")
    hint = "(set FORGE_DIST_TIMEOUT to change the bound)"
    if code == ERR_RECV_TIMEOUT:
        return (f"rank {rank} gave up after {bound_s:g}s waiting for {what} tile {tile} from "
                f"rank {peer} (call {epoch}) {hint}")
    if code == ERR_CREDIT_TIMEOUT:
        return (f"rank {rank} gave up after {bound_s:g}s waiting for rank {peer} to free its "
                f"receive slot for {what} tile {tile} (call {epoch}) {hint}")
    if code == ERR_UPSTREAM:
        return (f"rank {rank}: rank {peer} forwarded tile {tile} of {what} poisoned, because "
                f"a rank before it timed out (call {epoch})")
    if code == ERR_AHEAD:
        return (f"rank {rank}: the signal of {what} tile {tile} from rank {peer} already "
                f"belongs to a later call than this one (call {epoch}): this rank fell behind "
                f"by more than the bound and its tile may have been overwritten; the tile is "
                f"NaN. Call forge.reset() on every rank {hint}")
    return f"rank {rank}: unknown forge error code {code} (peer {peer}, tile {tile})"


@dataclass
class Channel:
    """This rank's view of a channel (see module docstring)."""

    transport: int
    recv: Tensor
    send: Tensor
    sig: Tensor
    ack: Tensor
    err: Tensor
    rank_stride: int = 0      # elements between ranks' copies of recv/send (SIM only)
    sig_rank_stride: int = 0  # elements between ranks' copies of sig/ack (SIM only)
    counter: Optional[Tensor] = None  # [epoch, programs done] int64, on err's device
    captured: bool = False  # launched inside a CUDA graph capture: errors are read by flush
    who: Optional[tuple] = None  # (rank, what) of the last launch, for errors read by flush
    explain: Optional[object] = None  # names a signature mismatch's argument (see describe)
    _err_host: Optional[Tensor] = None  # pinned copy of err, refreshed after every launch
    _err_words: Optional[object] = None  # numpy view of _err_host
    _pending: list = field(default_factory=list)

    def __post_init__(self):
        if self.counter is None:
            self.counter = torch.zeros(2, dtype=torch.int64, device=self.err.device)

    @property
    def epoch(self) -> int:
        """Calls completed on this channel (reads the device counter: a sync on the GPU)."""
        return int(self.counter[0])

    # -- error flag ----------------------------------------------------------------------
    def after_launch(self, rank: int, what: str, bound_s: float, exc_type,
                     explain=None) -> None:
        """Check (sync mode, or always on the CPU) or schedule a check of the error flag.

        Inside a CUDA graph capture nothing is checked or scheduled (a capture may neither
        sync nor query events); the channel is marked, and :meth:`poll` with ``wait`` (or
        ``forge_dist.sp.forge.flush``) after the replays reads the flag directly."""
        self.who = (rank, what)
        self.explain = explain
        if self.err.is_cuda and torch.cuda.is_current_stream_capturing():
            self.captured = True
            return
        if self.err.device.type != "cuda" or check_mode() == "sync":
            if self.err.device.type == "cuda":
                torch.cuda.current_stream(self.err.device).synchronize()
            self._raise_if_set(self.err.cpu(), rank, what, bound_s, exc_type)
            return
        if self._err_host is None:
            self._err_host = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=True)
            try:  # read the pinned words without a tensor op per call
                self._err_words = self._err_host.numpy()
            except RuntimeError:  # no numpy: index the tensor
                self._err_words = self._err_host
        else:
            self._check_words(rank, what, bound_s, exc_type)  # an earlier call's, if landed
        # the flag's words reach the host on their own: no event, no query, no sync
        self._err_host.copy_(self.err, non_blocking=True)

    def _check_words(self, rank, what, bound_s, exc_type) -> None:
        """Raise if the pinned copy of the flag shows an error.  The copies are
        asynchronous: one may still be on its way, so the device is synchronised (an error
        path only) before the whole record is read."""
        if int(self._err_words[0]) == 0:
            return
        torch.cuda.synchronize(self.err.device)
        words = self._err_host.clone()
        self._err_host.zero_()
        self._raise_if_set(words, rank, what, bound_s, exc_type)

    def poll(self, rank: int, what: str, bound_s: float, exc_type, wait: bool = False) -> None:
        """Raise if a finished call left an error; ``wait`` blocks for the last call (a
        device synchronisation: :func:`forge_dist.sp.flush`)."""
        if wait and self.captured:  # graph replays schedule no check: read the flag now
            # a graph may be replayed on any stream: wait for the whole device
            torch.cuda.synchronize(self.err.device)
            self._raise_if_set(self.err.cpu(), rank, what, bound_s, exc_type)
            return
        if self._err_host is None:
            return
        if wait:
            torch.cuda.synchronize(self.err.device)
        self._check_words(rank, what, bound_s, exc_type)

    def _raise_if_set(self, err_host, rank, what, bound_s, exc_type) -> None:
        """``err_host``: the error words on the host (a tensor, or the pinned words' array)."""
        if int(err_host[0]) == 0:
            return
        if rank < 0 and self.who is not None:  # read by flush: name the launch's rank
            rank, what = self.who
        record = err_host.tolist()
        msg = describe_error(record, rank, what, bound_s, self.explain)
        self.err.zero_()  # the next call starts clean (its kernel may still time out again)
        if self._err_host is not None and err_host is not self._err_words:
            # read from the device: a pinned copy of the same record must not raise again
            # (callers have synchronised, so no copy is in flight)
            self._err_host.zero_()
        # an argument error, as the host agreement raises it: not a communication failure
        raise (SignatureMismatch if int(record[0]) == ERR_SIGNATURE else exc_type)(msg)


def make_nvshmem_channel(n_tiles: int, tile_elems: int, dtype: torch.dtype,
                         device: torch.device, group) -> Channel:
    """Allocate a channel's symmetric buffers (collective over every rank, same order)."""
    recv = nvshmem.symmetric_empty((n_tiles, tile_elems), dtype, device, group)
    send = nvshmem.symmetric_empty((n_tiles, tile_elems), dtype, device, group)
    sigs = nvshmem.symmetric_empty((2, n_tiles), torch.int64, device, group)
    sigs.zero_()
    err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)
    # No peer may signal into sigs before every rank has zeroed its copy.
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    torch.cuda.synchronize(device)
    return Channel(NVSHMEM, recv, send, sigs[0], sigs[1], err)


def make_shared_sim_channel(key: str, n_tiles: int, tile_elems: int, dtype: torch.dtype,
                            rank: int, size: int, barrier) -> Channel:
    """This rank's channel of the simulated transport across processes (a gloo group on one
    machine): every rank maps the same shared-memory files, laid out as :class:`SimWorld`
    lays out its buffers, so a rank reaches a peer's copy at ``+ (pe - me) * stride`` as in
    one process -- but the ranks now run at the same time, as on GPUs.  ``key`` names the
    channel uniquely on the machine; ``barrier()`` synchronises the group (collective)."""
    folder = os.environ.get("FORGE_DIST_SIM_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    paths = {part: os.path.join(folder, f"forge_dist_{key}_{part}")
             for part in ("recv", "send", "sig")}
    sizes = {"recv": size * n_tiles * tile_elems, "send": size * n_tiles * tile_elems,
             "sig": size * 2 * n_tiles}
    dtypes = {"recv": dtype, "send": dtype, "sig": torch.int64}
    if rank == 0:
        for part, path in paths.items():
            torch.zeros(sizes[part], dtype=dtypes[part]).numpy().tofile(path)
    barrier()
    maps = {part: torch.from_file(path, shared=True, size=sizes[part], dtype=dtypes[part])
            for part, path in paths.items()}
    barrier()
    if rank == 0:  # the mappings keep the memory; the names are not needed any more
        for path in paths.values():
            os.unlink(path)
    recv = maps["recv"].view(size, n_tiles, tile_elems)
    send = maps["send"].view(size, n_tiles, tile_elems)
    sigs = maps["sig"].view(size, 2, n_tiles)
    return Channel(SIM, recv[rank], send[rank], sigs[rank, 0], sigs[rank, 1],
                   torch.zeros(ERR_WORDS, dtype=torch.int64),
                   rank_stride=n_tiles * tile_elems, sig_rank_stride=2 * n_tiles)


class SimWorld:
    """All ranks' channel buffers in one process (the simulated transport).

    Buffers carry a leading rank axis; rank ``r`` of a channel sees slice ``r`` and reaches
    a peer's copy at ``+ (pe - r) * stride``, as NVSHMEM's symmetric addressing would.
    Ranks' kernels are launched by the caller in chain order.
    """

    def __init__(self, size: int, device="cpu"):
        if size < 1:
            raise ValueError(f"SimWorld: size must be >= 1, got {size}")
        self.size = size
        self.device = torch.device(device)
        self._channels: dict = {}
        self.rank_views = [SimRank(self, r) for r in range(size)]

    def channels(self, key, n_tiles: int, tile_elems: int, dtype: torch.dtype):
        """One :class:`Channel` per rank for ``key`` (allocated on first use)."""
        if key not in self._channels:
            P = self.size
            recv = torch.zeros(P, n_tiles, tile_elems, dtype=dtype, device=self.device)
            send = torch.zeros(P, n_tiles, tile_elems, dtype=dtype, device=self.device)
            sigs = torch.zeros(P, 2, n_tiles, dtype=torch.int64, device=self.device)
            self._channels[key] = [
                Channel(SIM, recv[r], send[r], sigs[r, 0], sigs[r, 1],
                        torch.zeros(ERR_WORDS, dtype=torch.int64, device=self.device),
                        rank_stride=n_tiles * tile_elems, sig_rank_stride=2 * n_tiles)
                for r in range(P)]
        return self._channels[key]

    def __getitem__(self, rank: int) -> "SimRank":
        return self.rank_views[rank]


class SimRank:
    """Stands in for a process group in the simulated transport: ``(world, rank)``."""

    def __init__(self, world: SimWorld, rank: int):
        self.world, self.rank = world, rank

    def size(self) -> int:
        return self.world.size

    def __repr__(self) -> str:
        return f"SimRank({self.rank} of {self.world.size})"

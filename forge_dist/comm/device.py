"""Triton device primitives for rank-to-rank tiles, over NVSHMEM or the simulated transport.

Every function takes ``TRANSPORT: tl.constexpr``:

* ``SIM`` (0): all ranks' buffers live in one allocation with a leading rank axis.  A rank
  addresses a peer's copy of a "symmetric" buffer as ``local_ptr + (pe - me) * rank_stride``
  (elements), exactly as NVSHMEM translates a symmetric address.  Puts are plain stores and
  signals atomic exchanges, so the kernel runs under ``TRITON_INTERPRET=1`` or on one GPU.
* ``NVSHMEM`` (1): PyTorch's NVSHMEM device bitcode (``nvshmemx_putmem_signal_block``,
  ``nvshmemx_signal_op``, ``nvshmem_quiet`` ...).  ``rank_stride`` is ignored.

Signals are int64 epochs that only grow: a producer writes ``2 * epoch + poison`` (SET) and a
consumer waits for ``>= 2 * epoch``; the low bit tells a consumer that its producer gave up
(timeout) so the error travels down the chain instead of every rank waiting out the bound.
Nothing is ever reset, so back-to-back calls and CUDA-graph replays stay correct.

Waits are bounded.  With ``USE_CLOCK`` the bound is ``limit`` nanoseconds of
``%globaltimer``; without it (the interpreter, which cannot read the clock) it is ``limit``
polls -- in the simulated transport ranks run in chain order, so a signal that is not there
yet never arrives and one poll decides.
"""
from __future__ import annotations

import os
import types

import triton
import triton.language as tl



class _NoNvshmem:
    """Stands in for the bridge where it is missing (CPU builds): the NVSHMEM branches are
    then never taken, but Triton's dependency scan still resolves their names."""

    @staticmethod
    @triton.jit
    def _missing():
        tl.static_assert(False, "NVSHMEM device functions are not available in this torch")

    my_pe = n_pes = fence = quiet = signal_op = putmem_signal_block = _missing


def _load_bridge():
    """PyTorch's NVSHMEM device bridge, or :class:`_NoNvshmem` where it is missing.  The
    only place (with comm.nvshmem) that touches that private module."""
    try:
        # lazy: the bridge pulls in torch's inductor and dynamo (see _nv below)
        from torch.distributed._symmetric_memory import _nvshmem_triton as bridge
    except Exception:  # noqa: BLE001 - old torch
        return _NoNvshmem
    # the device functions are defined only when torch sees CUDA Triton
    return bridge if hasattr(bridge, "putmem_signal_block") else _NoNvshmem


# Imported on first use, not with the package: the bridge pulls in torch's inductor and
# dynamo (seconds on a CPU machine).  Triton resolves ``_nv.<name>`` when it compiles a
# kernel that reaches an NVSHMEM branch (the interpreter never does on the simulated
# transport), and accepts the global only as a plain module, hence a module whose
# attribute look-ups (PEP 562) load the bridge.
_nv = types.ModuleType(__name__ + "._nvshmem_bridge")


def _bridge_attr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_bridge(), name)


_nv.__getattr__ = _bridge_attr
_BRIDGE = None


def _bridge():
    global _BRIDGE
    if _BRIDGE is None:
        _BRIDGE = _load_bridge()
    return _BRIDGE

# NVSHMEM 3.4 header values (nvshmem_constants.h); PyTorch's docstrings give other numbers.
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)

# How a consumer hands a receive slot back (FORGE_DIST_CREDIT): "put" (default) a zero-byte
# putmem_signal_block, or "signal_op" (nvshmemx_signal_op issued by every thread).
CREDIT_BY_PUT = tl.constexpr(os.environ.get("FORGE_DIST_CREDIT", "put") != "signal_op")

# Error codes written by record_error (host side: forge_dist.comm.channel.describe_error).
ERR_NONE = tl.constexpr(0)
ERR_RECV_TIMEOUT = tl.constexpr(1)    # no data signal from the upstream peer
ERR_CREDIT_TIMEOUT = tl.constexpr(2)  # downstream peer never freed its receive slot
ERR_UPSTREAM = tl.constexpr(3)        # upstream peer forwarded a poisoned tile
ERR_AHEAD = tl.constexpr(4)           # the signal is already a later call's (lagged)
ERR_SIGNATURE = tl.constexpr(5)       # the upstream peer's call signature differs from ours

# Every tile carries a trailer of TRAILER elements after its data: the call's 60-bit
# signature word in three exact 20-bit chunks (forge_dist.sp.agreement), and a zero.
TRAILER = tl.constexpr(4)
STAGE_BLOCK = tl.constexpr(1024)  # elements the simulated put moves per step


@triton.jit
def my_pe(me, TRANSPORT: tl.constexpr):
    """This rank's PE number (``me`` in the simulated transport)."""
    if TRANSPORT == 1:
        return _nv.my_pe()
    else:
        return me


@triton.jit
def n_pes(n, TRANSPORT: tl.constexpr):
    """Number of PEs (``n`` in the simulated transport)."""
    if TRANSPORT == 1:
        return _nv.n_pes()
    else:
        return n


@triton.jit
def fence(TRANSPORT: tl.constexpr):
    """Order this thread's earlier puts before its later ones, per destination PE."""
    if TRANSPORT == 1:
        _nv.fence()
    else:
        tl.debug_barrier()


@triton.jit
def read_signal(sig_ptr):
    """Acquire-load of a local int64 signal word (system scope: peers write it over NVLink)."""
    return tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _now(USE_CLOCK: tl.constexpr):
    """The clock, the same value in every thread of the program: each thread reads its own
    ``%globaltimer``, and the max over a block-wide tensor makes the timeout decision of
    :func:`wait_ge` uniform (threads leaving the poll loop on different iterations would
    split the block's barriers and put calls)."""
    if USE_CLOCK:
        # 1024 elements: every thread of any block owns some, each read by its own thread
        # (a splat of one scalar read would be folded away as already uniform)
        per_thread = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                               [tl.zeros((1024,), tl.int32)], dtype=tl.int64,
                                               is_pure=False, pack=1)
        return tl.max(per_thread, axis=0)
    else:
        return tl.full((), 0, tl.int64)


@triton.jit
def wait_ge(sig_ptr, target, limit, USE_CLOCK: tl.constexpr):
    """Poll the local signal ``sig_ptr`` until it is ``>= target`` or the bound ``limit``
    (ns with ``USE_CLOCK``, else polls) runs out.  Returns the last value read (the caller
    compares it with ``target`` to tell success from a timeout)."""
    val = read_signal(sig_ptr)
    start = _now(USE_CLOCK)
    spent = tl.full((), 0, tl.int64)
    while (val < target) & (spent < limit):
        val = read_signal(sig_ptr)
        if USE_CLOCK:
            spent = _now(USE_CLOCK) - start
        else:
            spent = spent + 1
    return val


@triton.jit
def set_remote_signal(sig_ptr, value, pe, me, sig_rank_stride, TRANSPORT: tl.constexpr):
    """Atomically set the signal word ``sig_ptr`` (a symmetric address) on PE ``pe``."""
    if TRANSPORT == 1:
        if CREDIT_BY_PUT:
            # A zero-byte put-with-signal: NVSHMEM's block routine lets one thread write the
            # signal, where a bare signal_op would run in every thread of the program.
            _nv.putmem_signal_block(sig_ptr, sig_ptr, tl.full((), 0, tl.int64), sig_ptr,
                                    value.to(tl.int64), tl.full((), SIGNAL_SET, tl.int32),
                                    pe.to(tl.int32))
        else:
            _nv.signal_op(sig_ptr.to(tl.int64), value.to(tl.int64),
                          tl.full((), SIGNAL_SET, tl.int32), pe.to(tl.int32))
    else:
        tl.atomic_xchg(sig_ptr + (pe - me) * sig_rank_stride, value.to(tl.int64),
                       sem="release", scope="sys")


@triton.jit
def trailer_values(word, dtype: tl.constexpr):
    """``[TRAILER]`` values of a signature word: its three 20-bit chunks and a zero (integers
    below 2**20 are exact in every float type a state uses)."""
    i = tl.arange(0, TRAILER).to(tl.int64)
    chunk = (word >> (20 * tl.minimum(i, 2))) & 0xFFFFF
    return tl.where(i < 3, chunk, 0).to(dtype)


@triton.jit
def trailer_word(values):
    """The signature word back from :func:`trailer_values`."""
    i = tl.arange(0, TRAILER).to(tl.int64)
    chunk = values.to(tl.int64)
    return tl.sum(tl.where(i < 3, chunk << (20 * tl.minimum(i, 2)), 0), axis=0)


@triton.jit
def put_tile_signal(dst_ptr, src_ptr, offs, values, mask, trailer, nbytes, sig_ptr,
                    sig_value, pe, me, rank_stride, sig_rank_stride,
                    DATA_ELEMS: tl.constexpr, TRANSPORT: tl.constexpr):
    """Start sending one contiguous tile and its trailer to PE ``pe``, with its signal word.

    ``dst_ptr``/``sig_ptr`` are symmetric addresses (this rank's copy), ``src_ptr`` a local
    staging tile (a symmetric buffer, so the proxy transport can read it across nodes),
    ``offs`` the in-tile offsets of ``values``, ``trailer`` (``[TRAILER]``) goes after the
    tile's ``DATA_ELEMS`` elements.  The put reads ``nbytes`` from the staging tile, and the
    signal is written only after the whole tile is visible at the destination, so a
    consumer that sees it may read the tile.  The put is complete (delivered, its staging
    tile free) only after :func:`quiet_put`: the simulated transport delivers it there, the
    latest point NVSHMEM allows, so a missing ``quiet_put`` loses the tile in tests.
    """
    tl.store(src_ptr + offs, values, mask=mask)
    tl.store(src_ptr + DATA_ELEMS + tl.arange(0, TRAILER), trailer)
    tl.debug_barrier()  # every thread's part of the tile is staged before the block put
    if TRANSPORT == 1:
        _nv.putmem_signal_block(dst_ptr, src_ptr, nbytes, sig_ptr, sig_value.to(tl.int64),
                                tl.full((), SIGNAL_SET, tl.int32), pe.to(tl.int32))


@triton.jit
def quiet_put(dst_ptr, src_ptr, sig_ptr, sig_value, pe, me, rank_stride, sig_rank_stride,
              issued, DATA_ELEMS: tl.constexpr, TRANSPORT: tl.constexpr):
    """Complete this thread's puts (NVSHMEM ``quiet``).  The simulated transport delivers
    here the put :func:`put_tile_signal` started (``issued``: whether it did): the staged
    bytes, as they are now, then the signal."""
    if TRANSPORT == 1:
        _nv.quiet()
    else:
        if issued:
            k = tl.arange(0, STAGE_BLOCK)
            for start in tl.static_range(0, DATA_ELEMS + TRAILER, STAGE_BLOCK):
                m = start + k < DATA_ELEMS + TRAILER
                tl.store(dst_ptr + (pe - me) * rank_stride + start + k,
                         tl.load(src_ptr + start + k, mask=m), mask=m)
            tl.debug_barrier()
            tl.atomic_xchg(sig_ptr + (pe - me) * sig_rank_stride, sig_value.to(tl.int64),
                           sem="release", scope="sys")


@triton.jit
def record_error(err_ptr, code, peer, tile, epoch, detail0=0, detail1=0):
    """First error wins: ``err = [code, peer, tile, epoch, detail0, detail1]`` (int64), read
    by the host (the details: the peer's and this rank's signature words)."""
    old = tl.atomic_cas(err_ptr, tl.full((), 0, tl.int64), tl.full((), code, tl.int64))
    if old == 0:
        tl.store(err_ptr + 1, peer.to(tl.int64))
        tl.store(err_ptr + 2, tile.to(tl.int64))
        tl.store(err_ptr + 3, epoch.to(tl.int64))
        tl.store(err_ptr + 4, detail0)
        tl.store(err_ptr + 5, detail1)

"""The ``forge`` strategy: the inter-rank chain as one GPU-initiated Triton kernel per rank.

Each program of the kernel owns one tile ``(b, h, k-tile, v-tile)`` of the state
``[B, H, K, V]`` (dense transitions: a whole-K tile of V columns, because ``M`` mixes rows).
On rank r, forward:

1. wait until the tile's signal from rank r-1 reaches ``2 * epoch`` (bounded; a timeout
   records ``[code, peer, tile, epoch]`` for the host and poisons what it forwards);
2. load the received tile, write it into ``S_in`` (for the local merge) and give rank r-1
   its credit (the receive slot may be reused);
3. ``S_out = M S_in + dS`` for the tile (dense: a ``K x K`` by ``K x BV`` fp32 matmul in
   row blocks of 32, 3xTF32 on the GPU);
4. wait for rank r+1's credit of the previous call, then ``putmem_signal_block`` the tile
   into rank r+1's receive buffer with signal ``2 * epoch``.

Rank 0 starts from ``S0``; the last rank only receives.  Backward runs the same kernel from
rank P-1 down to 0 with ``M^T``, writing ``lam(r+1)`` (received) and ``lam(r)`` (combined).
No host synchronisation: the host launches one kernel and returns; the error flag is read
lazily (``FORGE_DIST_FORGE_CHECK=lazy``, default) or right after the kernel (``sync``).

CUDA graphs: the epoch is read from a device counter that the kernel itself advances
(:mod:`forge_dist.comm.channel`), so a captured call replays with a fresh epoch every time
and never accepts the previous replay's signal.  Make one eager call per state shape before
capturing (it allocates the channel), and call :func:`flush` after replays to surface a
timeout (a capture schedules no error check).

Passing a :class:`forge_dist.comm.sim.SimRank` as ``group`` runs the same kernel over the
simulated transport (all ranks in one process, launched in chain order by the caller).

Collective rules (as for NCCL): every rank of the group makes the same state-pass calls in
the same order; the first call with a new ``(shape, dtype, direction)`` allocates symmetric
buffers, which is a collective over NVSHMEM's world.
"""
from __future__ import annotations

import os
import random
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import comm
from ..comm import channel as chan
from ..comm import device as dev
from ..comm import nvshmem
from ..variants.transitions import Kind
from . import agreement, p2p
from .agreement import TRAILER
from .base import Strategy, register

assert TRAILER == dev.TRAILER.value  # the host's tile layout is the kernel's

_KIND_CODE = {Kind.IDENTITY: 0, Kind.SCALAR: 1, Kind.DIAGONAL: 2, Kind.DENSE: 3}
_SRC_FIRST, _SRC_ZERO, _SRC_RECV = 0, 1, 2


@triton.jit
def _send_tile(y, mask, poison, pid, epoch, recv_ptr, send_ptr, sig_ptr, ack_ptr, err_ptr,
               tile_base, tile_offs, me, next_pe, limit, nbytes, rank_stride,
               sig_rank_stride, word, DATA_ELEMS: tl.constexpr,
               TRANSPORT: tl.constexpr, USE_CLOCK: tl.constexpr):
    """Put tile ``y`` with its signal ``2 * epoch + poison`` into ``next_pe``'s receive slot
    ``pid``, once that rank has credited the previous call's (bounded).  ``DATA_ELEMS``:
    the slot's elements before its trailer (what the caller staged beyond ``y`` goes too)."""
    credit = dev.wait_ge(ack_ptr + pid, epoch - 1, limit, USE_CLOCK)
    sent = credit >= epoch - 1
    if not sent:
        # The slot may still be read by the lagging consumer: leave the data alone and
        # send only the poisoned signal (a zero-byte put).  A consumer still on the
        # previous call sees it as "ahead" and fails instead of reading on.
        dev.record_error(err_ptr, dev.ERR_CREDIT_TIMEOUT, next_pe, pid, epoch)
        dev.set_remote_signal(sig_ptr + pid, 2 * epoch + 1, next_pe, me, sig_rank_stride,
                              TRANSPORT)
    else:
        dev.put_tile_signal(recv_ptr + tile_base, send_ptr + tile_base, tile_offs, y, mask,
                            dev.trailer_values(word, y.dtype), nbytes, sig_ptr + pid,
                            2 * epoch + poison, next_pe, me, rank_stride, sig_rank_stride,
                            DATA_ELEMS, TRANSPORT)
    dev.quiet_put(recv_ptr + tile_base, send_ptr + tile_base, sig_ptr + pid,
                  2 * epoch + poison, next_pe, me, rank_stride, sig_rank_stride, sent,
                  DATA_ELEMS, TRANSPORT)


@triton.jit
def _state_tile(pid, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """Program ``pid``'s tile of a ``[B, H, K, V]`` state, V tiles fastest: ``(b*h, its rows
    rk [BK], its columns rv [BV], the in-bounds mask, the state offsets, the offsets in a
    contiguous [BK, BV] tile)``."""
    n_k = tl.cdiv(K, BK)
    n_v = tl.cdiv(V, BV)
    iv = pid % n_v
    ik = (pid // n_v) % n_k
    bh = (pid // (n_v * n_k)).to(tl.int64)
    rk = ik * BK + tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mask = (rk[:, None] < K) & (rv[None, :] < V)
    offs = bh * K * V + rk[:, None] * V + rv[None, :]
    tile_offs = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    return bh, rk, rv, mask, offs, tile_offs


@triton.jit(do_not_specialize=["me", "prev_pe", "next_pe", "limit", "nbytes",
                               "rank_stride", "sig_rank_stride", "word", "nseg", "nbh"])
def _forge_chain_kernel(
    first_ptr, d_ptr, m_ptr, x_out_ptr, y_out_ptr,
    recv_ptr, send_ptr, sig_ptr, ack_ptr, err_ptr, counter_ptr,
    me, prev_pe, next_pe, limit, nbytes, rank_stride, sig_rank_stride, word,
    K, V, stride_mi, stride_mj, nseg, nbh,
    KIND: tl.constexpr, SRC: tl.constexpr, SEND: tl.constexpr, WRITE_Y: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, TRANSPORT: tl.constexpr, USE_CLOCK: tl.constexpr,
    BJ: tl.constexpr = 32, PREC: tl.constexpr = "ieee", FOLD: tl.constexpr = False,
    SEND_FIRST: tl.constexpr = False,
):
    """One (b*h, k-tile, v-tile) per program; see the module docstring for the steps.

    first/d/x_out/y_out: ``[B, H, K, V]`` contiguous; m: ``[B, H]``, ``[B, H, K]`` or
    ``[B, H, K, K]`` (strides ``stride_mi``/``stride_mj`` over the last two, swapped for
    ``M^T``); recv/send: ``[n_tiles, BK * BV + TRAILER]`` (the trailer carries ``word``, the
    call's signature, checked by the receiver); sig/ack: ``[n_tiles]`` int64; err: ``[6]``;
    counter: ``[2]`` int64 ``[epoch of the last call, programs of this call done]``.
    Dense only: ``BJ`` is the row block of x per ``tl.dot``, ``PREC`` its input precision
    (``"tf32x3"`` for fp32 states on the GPU, ``"ieee"`` otherwise).
    SEND_FIRST (a round of the log-depth scan, :mod:`.scan`): the program puts ``d``'s tile
    to ``next_pe`` before it waits for ``prev_pe``'s (the two are different ranks), then
    receives into ``x_out`` (and ``y_out = M x + d``); it forwards nothing it received.
    FOLD (a plan's forward, not dense): ``d`` is the shard's segment summaries ``hs [nseg,
    B, H, K, V]`` and ``m`` their summed log decays ``gt [nseg, B, H, K]`` (KIND 0: unused),
    ``nbh = B * H``; the program folds its tile of them into the shard's ``(M, delta)``
    before it waits, so the summaries are read while the incoming tile is on its way.
    """
    pid = tl.program_id(0)
    bh, rk, rv, mask, offs, tile_offs = _state_tile(pid, K, V, BK, BV)
    tile_base = pid.to(tl.int64) * (BK * BV + dev.TRAILER)
    poison = tl.full((), 0, tl.int64)
    if FOLD:
        # the segment scan of the summaries (as the output walks fold it), from a zero start
        d_fold = tl.zeros((BK, BV), dtype=tl.float32)
        log_m = tl.zeros((BK,), dtype=tl.float32)
        if SEND or WRITE_Y:
            for s in range(0, nseg):
                slot = s * nbh + bh
                if KIND != 0:
                    g_s = tl.load(m_ptr + slot * K + rk, mask=rk < K, other=0.0)
                    d_fold = d_fold * tl.exp(g_s)[:, None]
                    log_m += g_s
                d_fold += tl.load(d_ptr + slot * K * V + rk[:, None] * V + rv[None, :],
                                  mask=mask, other=0.0)
    # The epoch lives on the device (a CUDA graph replays the same arguments): every program
    # reads it before it counts itself done below, so none can see the bumped value.
    epoch = tl.load(counter_ptr, cache_modifier=".cg") + 1

    if SEND_FIRST and SEND:
        own = tl.load(d_ptr + offs, mask=mask, other=0.0)
        _send_tile(own, mask, 0, pid, epoch, recv_ptr, send_ptr, sig_ptr, ack_ptr, err_ptr,
                   tile_base, tile_offs, me, next_pe, limit, nbytes, rank_stride,
                   sig_rank_stride, word, BK * BV, TRANSPORT, USE_CLOCK)

    if SRC == 2:
        target = 2 * epoch
        got = dev.wait_ge(sig_ptr + pid, target, limit, USE_CLOCK)
        timed_out = got < target
        poisoned = got == target + 1
        # The producer can run at most one call ahead only after this rank's credit, so a
        # signal past ``target + 1`` means this call lagged past the bound and the slot may
        # hold a later call's tile: never accept it.
        ahead = got > target + 1
        if timed_out:
            dev.record_error(err_ptr, dev.ERR_RECV_TIMEOUT, prev_pe, pid, epoch)
        if poisoned:
            dev.record_error(err_ptr, dev.ERR_UPSTREAM, prev_pe, pid, epoch)
        if ahead:
            dev.record_error(err_ptr, dev.ERR_AHEAD, prev_pe, pid, epoch)
        # The sender's signature word: a peer that called with other arguments (a repeated
        # signature skips the host agreement) is caught here, and its tile is never used.
        theirs = dev.trailer_word(tl.load(recv_ptr + tile_base + BK * BV
                                          + tl.arange(0, dev.TRAILER), cache_modifier=".cg"))
        mismatch = (got == target) & (theirs != word)
        if mismatch:
            dev.record_error(err_ptr, dev.ERR_SIGNATURE, prev_pe, pid, epoch, theirs, word)
        poison = ((got != target) | mismatch).to(tl.int64)

    if KIND == 3:
        # dense: BK covers all of K (M mixes rows).  y = M x + d is accumulated over row
        # blocks of x (and column blocks of M) so that neither the K x K block of M nor the
        # whole tile of x is held in registers: whole, they spilled ~18 KB per thread.
        y = tl.zeros((BK, BV), dtype=tl.float32 if PREC != "ieee" else d_ptr.dtype.element_ty)
        for j0 in tl.static_range(0, BK, BJ):
            rj = j0 + tl.arange(0, BJ)
            jmask = (rj[:, None] < K) & (rv[None, :] < V)
            if SRC == 0:
                xb = tl.load(first_ptr + bh * K * V + rj[:, None] * V + rv[None, :], mask=jmask,
                             other=0.0)
            elif SRC == 1:
                xb = tl.zeros((BJ, BV), dtype=d_ptr.dtype.element_ty)
                tl.store(x_out_ptr + bh * K * V + rj[:, None] * V + rv[None, :], xb, mask=jmask)
            else:
                # .cg: the tile arrived over NVLink into L2; never serve a stale L1 line.
                xb = tl.load(recv_ptr + tile_base + rj[:, None] * BV + tl.arange(0, BV)[None, :],
                             mask=jmask, other=0.0, cache_modifier=".cg")
                xb = tl.where(poison != 0, float("nan"), xb).to(xb.dtype)
                tl.store(x_out_ptr + bh * K * V + rj[:, None] * V + rv[None, :], xb, mask=jmask)
            if ((SEND and not SEND_FIRST) or WRITE_Y) and SRC != 1:
                mm = tl.load(m_ptr + bh * K * K + rk[:, None] * stride_mi + rj[None, :] * stride_mj,
                             mask=(rk[:, None] < K) & (rj[None, :] < K), other=0.0)
                y += tl.dot(mm, xb, input_precision=PREC)
    else:
        if SRC == 0:
            x = tl.load(first_ptr + offs, mask=mask, other=0.0)
        elif SRC == 1:
            x = tl.zeros((BK, BV), dtype=d_ptr.dtype.element_ty)
            tl.store(x_out_ptr + offs, x, mask=mask)
        else:
            x = tl.load(recv_ptr + tile_base + tile_offs, mask=mask, other=0.0,
                        cache_modifier=".cg")
            # a tile that never came (or came poisoned) is NaN, never the previous call's
            x = tl.where(poison != 0, float("nan"), x).to(x.dtype)
            tl.store(x_out_ptr + offs, x, mask=mask)
        if KIND == 0:
            y = x
        elif FOLD:
            y = tl.exp(log_m)[:, None] * x
        elif KIND == 1:
            y = tl.load(m_ptr + bh) * x
        else:
            m = tl.load(m_ptr + bh * K + rk, mask=rk < K, other=0.0)
            y = m[:, None] * x

    if SRC == 2:
        tl.debug_barrier()  # the whole tile is read before the slot is handed back
        dev.set_remote_signal(ack_ptr + pid, epoch, prev_pe, me, sig_rank_stride, TRANSPORT)

    if (SEND and not SEND_FIRST) or WRITE_Y:  # a send-first round sent d already
        if FOLD:
            y = (y + d_fold).to(d_ptr.dtype.element_ty)
        else:
            y = (y + tl.load(d_ptr + offs, mask=mask, other=0.0)).to(d_ptr.dtype.element_ty)
        if WRITE_Y:
            tl.store(y_out_ptr + offs, y, mask=mask)
        if SEND and not SEND_FIRST:
            _send_tile(y, mask, poison, pid, epoch, recv_ptr, send_ptr, sig_ptr, ack_ptr,
                       err_ptr, tile_base, tile_offs, me, next_pe, limit, nbytes, rank_stride,
                       sig_rank_stride, word, BK * BV, TRANSPORT, USE_CLOCK)

    # The last program to finish publishes this call's epoch for the next launch.  The
    # barrier keeps every thread's reads of the counter and puts ahead of the count.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, epoch)
        tl.store(counter_ptr + 1, 0)


@triton.jit(do_not_specialize=["me", "pos", "size", "limit", "nbytes", "rank_stride",
                               "sig_rank_stride", "word", "n_tiles"])
def _scan_rounds_kernel(
    d_ptr, m_ptr, x_out_ptr, pe_ptr,
    recv_ptr, send_ptr, sig_ptr, ack_ptr, err_ptr, counter_ptr,
    me, pos, size, limit, nbytes, rank_stride, sig_rank_stride, word, K, V, n_tiles,
    nseg, nbh,
    KIND: tl.constexpr, HAS_M: tl.constexpr, M_LOG: tl.constexpr, ROUNDS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, TRANSPORT: tl.constexpr, USE_CLOCK: tl.constexpr,
    FOLD: tl.constexpr = False,
):
    """Every round of the log-depth scan (:mod:`.scan`) in one launch: one ``(b*h, k-tile,
    v-tile)`` tile of the state per program, for identity, scalar and diagonal transitions.

    The program holds its tile of this position's map, ``incl`` (``d [BK, BV]`` and the
    transition's rows ``m [BK]``: the decay of each state row, 1 for the identity), and of
    the maps before it that arrived, ``acc`` (the identity to start).  In round ``k``
    (``span = 2**k``) it puts ``incl`` to position ``pos + span`` (slot ``k``: the tile, then
    ``m``, then the trailer word; after that peer credited the previous call's) and takes
    what position ``pos - span`` put, which comes before what it holds:
    ``acc = acc o arrived`` and ``incl = incl o arrived``, ``(m2, d2) o (m1, d1) = (m2 m1,
    m2 d1 + d2)``.  ``x_out`` gets ``acc``'s ``d``, this position's incoming state (zeros
    at position 0).  Waits are bounded and checked as the chain kernel's: a tile that timed
    out, came poisoned or from a call with another signature is NaN and poisons what this
    rank sends on.

    d/x_out: ``[B, H, K, V]`` contiguous; m: ``[B, H]`` (KIND 1) or ``[B, H, K]`` (KIND 2), or
    with M_LOG the log decays ``[B, H, K]`` of either kind (a plan's summed log decays,
    exponentiated here); not read without HAS_M (a position whose own transition no round
    reads, as 1); pe:
    ``[size]`` int64, the PE of each position; recv/send: ``[ROUNDS * n_tiles, BK * (BV + 1)
    + TRAILER]``; sig/ack: ``[ROUNDS * n_tiles]`` int64; err, counter: as the chain
    kernel's.  FOLD (a plan's forward, as the chain kernel's): ``d`` is the shard's segment
    summaries ``hs [nseg, B, H, K, V]`` and ``m`` their log decays ``gt [nseg, B, H, K]``
    (``nbh = B * H``), folded into this position's map here instead of by a launch before.
    """
    pid = tl.program_id(0)
    bh, rk, rv, mask, offs, tile_offs = _state_tile(pid, K, V, BK, BV)
    DATA: tl.constexpr = BK * (BV + 1)  # the tile, then its transition rows
    # (the last position sends nothing: it reads no d)
    sends = pos + 1 < size
    if FOLD:  # the segment scan of the summaries, from a zero start
        incl_d = tl.zeros((BK, BV), dtype=d_ptr.dtype.element_ty)
        log_m = tl.zeros((BK,), dtype=m_ptr.dtype.element_ty)
        if sends:
            for s in range(0, nseg):
                if KIND != 0:
                    g_s = tl.load(m_ptr + (s * nbh + bh) * K + rk, mask=rk < K, other=0.0)
                    incl_d = (incl_d * tl.exp(g_s)[:, None]).to(incl_d.dtype)
                    log_m += g_s
                incl_d += tl.load(d_ptr + s * nbh * K * V + offs, mask=mask, other=0.0)
    else:
        incl_d = tl.load(d_ptr + offs, mask=mask & sends, other=0.0)
    one = tl.full((BK,), 1.0, incl_d.dtype)
    if KIND == 0 or not HAS_M:
        incl_m = one
    elif FOLD:  # (the decays were read for the fold: position 0 sends its own too)
        incl_m = tl.exp(log_m).to(one.dtype)
    elif M_LOG:
        incl_m = tl.exp(tl.load(m_ptr + bh * K + rk, mask=rk < K, other=0.0)).to(one.dtype)
    elif KIND == 1:
        incl_m = one * tl.load(m_ptr + bh)
    else:
        incl_m = tl.load(m_ptr + bh * K + rk, mask=rk < K, other=1.0)
    acc_d = tl.zeros((BK, BV), dtype=incl_d.dtype)
    acc_m = one
    poison = tl.full((), 0, tl.int64)
    epoch = tl.load(counter_ptr, cache_modifier=".cg") + 1
    target = 2 * epoch
    for k in tl.static_range(ROUNDS):
        slot = k * n_tiles + pid
        tile_base = slot.to(tl.int64) * (DATA + dev.TRAILER)
        dst = pos + (1 << k)
        src = pos - (1 << k)
        if dst < size:
            tl.store(send_ptr + tile_base + BK * BV + tl.arange(0, BK), incl_m)
            _send_tile(incl_d, mask, poison, slot, epoch, recv_ptr, send_ptr, sig_ptr,
                       ack_ptr, err_ptr, tile_base, tile_offs, me, tl.load(pe_ptr + dst),
                       limit, nbytes, rank_stride, sig_rank_stride, word, DATA, TRANSPORT,
                       USE_CLOCK)
        if src >= 0:
            src_pe = tl.load(pe_ptr + src)
            got = dev.wait_ge(sig_ptr + slot, target, limit, USE_CLOCK)
            if got < target:
                dev.record_error(err_ptr, dev.ERR_RECV_TIMEOUT, src_pe, pid, epoch)
            if got == target + 1:
                dev.record_error(err_ptr, dev.ERR_UPSTREAM, src_pe, pid, epoch)
            if got > target + 1:  # a later call's tile: this call lagged past the bound
                dev.record_error(err_ptr, dev.ERR_AHEAD, src_pe, pid, epoch)
            theirs = dev.trailer_word(tl.load(recv_ptr + tile_base + DATA
                                              + tl.arange(0, dev.TRAILER), cache_modifier=".cg"))
            mismatch = (got == target) & (theirs != word)
            if mismatch:
                dev.record_error(err_ptr, dev.ERR_SIGNATURE, src_pe, pid, epoch, theirs, word)
            bad = (got != target) | mismatch
            poison = poison | bad.to(tl.int64)
            # .cg: the tile arrived over NVLink into L2; never serve a stale L1 line
            r_d = tl.load(recv_ptr + tile_base + tile_offs, mask=mask, other=0.0,
                          cache_modifier=".cg")
            r_m = tl.load(recv_ptr + tile_base + BK * BV + tl.arange(0, BK),
                          cache_modifier=".cg")
            r_d = tl.where(bad, float("nan"), r_d).to(r_d.dtype)
            r_m = tl.where(bad, float("nan"), r_m).to(r_m.dtype)
            tl.debug_barrier()  # the whole tile is read before the slot is handed back
            dev.set_remote_signal(ack_ptr + slot, epoch, src_pe, me, sig_rank_stride,
                                  TRANSPORT)
            acc_d = acc_m[:, None] * r_d + acc_d
            acc_m = acc_m * r_m
            incl_d = incl_m[:, None] * r_d + incl_d
            incl_m = incl_m * r_m
    tl.store(x_out_ptr + offs, acc_d, mask=mask)

    # the last program to finish publishes this call's epoch (as the chain kernel's)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, epoch)
        tl.store(counter_ptr + 1, 0)


_WRAPPED: dict = {}  # kernel -> its NVSHMEM-linked build (nvshmem.wrap), made once


def _for_transport(kernel, transport: int):
    """``kernel`` as built for ``transport``: itself for the simulated one, else linked with
    NVSHMEM's device library."""
    if transport == comm.SIM:
        return kernel
    if kernel not in _WRAPPED:
        _WRAPPED[kernel] = nvshmem.wrap(kernel)
    return _WRAPPED[kernel]


def _kernel(transport: int):
    return _for_transport(_forge_chain_kernel, transport)


def _scan_kernel(transport: int):
    return _for_transport(_scan_rounds_kernel, transport)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_shape(kind: Kind, K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)`` of one program's tile.

    Dense: all of K (``M`` mixes rows) by ``BV`` columns, at least 16 each for ``tl.dot``.
    Other kinds: up to 8192 elements (32 KiB fp32), cut along V first and then K (so a
    vector state ``[B, 1, D, 1]`` is cut along D).  ``FORGE_DIST_FORGE_BV`` overrides BV.
    """
    env_bv = os.environ.get("FORGE_DIST_FORGE_BV")
    if kind is Kind.DENSE:
        bk = max(16, _pow2(K))
        bv = int(env_bv) if env_bv else max(16, min(_pow2(V), 8192 // bk))
        return bk, max(16, _pow2(bv))
    bv = int(env_bv) if env_bv else min(_pow2(V), 64)
    bv = _pow2(bv)
    bk = min(_pow2(K), max(16, 8192 // bv))
    return bk, bv


class _Where:
    """Rank, size, transport and peers of a call: a ``SimRank`` (the simulated transport in
    one process), a gloo group (the simulated transport across processes, in shared
    memory: the ranks run concurrently, as on GPUs) or any other process group (NVSHMEM)."""

    def __init__(self, group):
        self.shared = False
        if isinstance(group, chan.SimRank):
            self.sim = group.world
            self.rank, self.size = group.rank, group.world.size
            self.transport = comm.SIM
            self.pe = lambda r: r
        else:
            self.sim = None
            self.rank, self.size = p2p.rank_and_size(group)
            if dist.get_backend(group) == "gloo":
                self.shared = True
                self.transport = comm.SIM
                self.pe = lambda r: r
            else:
                self.transport = comm.NVSHMEM
                self.pe = lambda r: nvshmem.global_rank(self.group, r)
        # weak: the cache of these (_WHERE) must not keep a destroyed group alive until the
        # interpreter exits, where gloo's teardown aborts the process
        self._group = weakref.ref(group)

    @property
    def group(self):
        return self._group()

    def explain(self, peer: int, peer_word: int, my_word: int) -> str:
        """Why a peer's signature word differs from this rank's (for an error message)."""
        return agreement.explain(None if self.sim is not None else self.group, peer,
                                 peer_word, my_word)


_WHERE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SIM_POLLS_PER_S = 20000  # interpreted polls of a signal per second, roughly
_SHARED_CALLS: dict = {}


def _shared_name(where: _Where, key) -> str:
    """A name for a shared-memory channel, the same on every rank of the group and unique
    on the machine: the master's address/port (the rendezvous), the group and the key."""
    base = f"{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"
    n = _SHARED_CALLS[base] = _SHARED_CALLS.get(base, 0) + 1  # same order on every rank
    name = getattr(where.group, "group_name", "") or "g"
    return f"{os.getuid()}_{base}_{name}_{n}".replace(".", "-").replace(":", "-")


def _jitter() -> None:
    """``FORGE_DIST_SIM_JITTER_MS``: a random delay before each simulated launch, so that
    tests see the ranks interleave in many orders (an ordering bug then fails a test)."""
    raw = os.environ.get("FORGE_DIST_SIM_JITTER_MS")
    if raw:
        time.sleep(random.random() * float(raw) / 1000)


def _where(group) -> _Where:
    """The cached :class:`_Where` of ``group`` (a group's ranks never change)."""
    w = _WHERE.get(group)
    if w is None:
        w = _WHERE[group] = _Where(group)
    return w


_CHANNELS: dict = {}


def _channel(where: _Where, direction: str, like: torch.Tensor, kind: Kind,
             allocate: bool = True, slots: int = 1, m_rows: bool = False):
    """This rank's channel for ``(direction, shape, dtype, device, group)`` and its tile.

    A new key allocates symmetric buffers (a collective); ``allocate=False`` (inside a CUDA
    graph capture, where a collective cannot run) raises instead.  ``slots``: slots per
    tile (the fused scan's rounds); ``m_rows``: each slot also carries ``BK`` transition
    rows after its tile."""
    B, H, K, V = like.shape
    bk, bv = tile_shape(kind, K, V)
    n_tiles = B * H * triton.cdiv(K, bk) * triton.cdiv(V, bv) * slots
    key = (direction, B, H, K, V, bk, bv, like.dtype, like.device) + (
        (slots, m_rows) if slots != 1 or m_rows else ())
    tile_elems = bk * bv + (bk if m_rows else 0) + TRAILER
    if where.sim is not None:
        return where.sim.channels(key, n_tiles, tile_elems, like.dtype)[where.rank], bk, bv
    gkey = key + (getattr(where.group, "group_name", None) or id(where.group),)
    if gkey not in _CHANNELS and where.shared:
        _CHANNELS[gkey] = chan.make_shared_sim_channel(
            _shared_name(where, key), n_tiles, tile_elems, like.dtype, where.rank,
            where.size, lambda: p2p.barrier(where.group))
    if gkey not in _CHANNELS:
        if not allocate:
            raise RuntimeError(
                f"forge: the first call with state shape {tuple(like.shape)} "
                f"({direction}, {like.dtype}) allocates symmetric buffers, a collective that "
                "cannot run inside a CUDA graph capture; make one call eagerly (a warm-up "
                "step) on every rank before capturing")
        _CHANNELS[gkey] = chan.make_nvshmem_channel(n_tiles, tile_elems, like.dtype,
                                                    like.device, where.group)
    return _CHANNELS[gkey], bk, bv


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted() -> bool:
    """Whether the kernel was built for Triton's interpreter (CPU simulated transport)."""
    return not isinstance(_forge_chain_kernel, triton.runtime.JITFunction)


def _dense_precision(d: torch.Tensor) -> str:
    """fp32 states on the GPU: 3xTF32 tensor-core dots (fp32-level error, docs/design.md section 2);
    fp64 (and the interpreter) stay IEEE."""
    return "tf32x3" if d.dtype == torch.float32 and d.is_cuda and not _interpreting() else "ieee"


_RESETS = 0  # reset() calls so far: a kept relaunch is valid only on the channels it saw


class _Relaunch:
    """A chain launch kept after its first call (a plan's, whose buffers never change): the
    compiled kernel's launcher called directly, without Triton's per-call binding and
    specialisation (``JITFunction.run``: tens of microseconds of host time).

    Only the per-call pointers (``first_ptr``, rank 0's start, which may be the caller's
    ``initial_state``, and those named in ``per_call``: a halo's send and receive,
    :func:`pass_along`) and the wait bound may differ between calls; a pointer Triton would
    specialise differently (not 16-byte aligned) or a :func:`reset` since sends the call back
    through the JIT."""

    def __init__(self, kernel, fn, n_tiles: int, values: dict, where, what, bound, ch,
                 per_call: tuple = ()):
        self._run = kernel.run
        self._function = kernel.function
        self._packed = kernel.packed_metadata
        self._grid = (n_tiles, 1, 1)
        names = [p.name for p in fn.params]
        # a constexpr the launch left at its default (the scan kernel's FOLD) takes it here
        self._values = [values[p.name] if p.name in values or not p.has_default else p.default
                        for p in fn.params]
        self._device = values["d_ptr"].device.index
        # the slots a call fills with its own tensors (the chain kernel's first_ptr; the
        # scan kernel has none) hold the dummy between calls: no caller tensor is kept
        self._dummy = values["d_ptr"]
        self._per_call = {name: names.index(name)
                          for name in ("first_ptr", *per_call) if name in names}
        for i in self._per_call.values():
            self._values[i] = self._dummy
        self._resets = _RESETS
        self.where, self.what, self.ch, self.bound = where, what, ch, bound

    def usable(self, **tensors: Optional[torch.Tensor]) -> bool:
        """Whether this call may relaunch: no reset since, the same wait bound (Triton typed
        ``limit`` by its first value), no launch hook or ``FORGE_DIST_JIT_RELAUNCH=0`` (the
        JIT path, which hooks see), and the per-call ``tensors`` (by parameter name; ``None``
        keeps the dummy) as aligned as the compiled kernel's."""
        return (self._resets == _RESETS and p2p.timeout_seconds() == self.bound
                and _relaunch_allowed()
                and all(t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0)
                        for t in tensors.values()))

    def __call__(self, **tensors: Optional[torch.Tensor]) -> None:
        values = self._values
        given = [(self._per_call[name], t) for name, t in tensors.items() if t is not None]
        for i, t in given:
            values[i] = t
        g = self._grid
        try:
            self._run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._device),
                      self._function, self._packed, None, None, None, *values)
        finally:
            for i, _ in given:
                values[i] = self._dummy
        where = self.where
        self.ch.after_launch(where.rank, self.what, self.bound, p2p.StatePassTimeout,
                             where.explain)


def _relaunch_allowed() -> bool:
    """``FORGE_DIST_JIT_RELAUNCH`` is not ``0`` and no Triton launch hook is installed (as
    the plans' own relaunches, forge_dist/kernels/jit_launch.py)."""
    if os.environ.get("FORGE_DIST_JIT_RELAUNCH", "1") == "0":
        return False
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is None or not bool(getattr(hook, "calls", True))


def _wait_limit(where: _Where, d: torch.Tensor):
    """``(bound s, use the clock, limit)`` of a launch's bounded waits on ``d``'s device: ns of
    ``%globaltimer`` on the GPU; polls for concurrent simulated ranks (about the bound); one
    poll for ranks run in order in one process (a signal not there never comes).  Simulated
    ranks first sleep a random jitter (:func:`_jitter`)."""
    if not d.is_cuda and not interpreted():
        raise RuntimeError("forge: CPU tensors run the simulated transport under Triton's "
                           "interpreter; set TRITON_INTERPRET=1 before importing forge_dist")
    bound = p2p.timeout_seconds()
    use_clock = d.is_cuda and not _interpreting()
    if use_clock:
        limit = int(bound * 1e9)
    elif where.shared:
        limit = int(bound * _SIM_POLLS_PER_S)
    else:
        limit = 1
    if where.shared:
        _jitter()
    return bound, use_clock, limit


def _run_chain(where: _Where, direction: str, kind: Kind, M: Optional[torch.Tensor],
               first: Optional[torch.Tensor], d: torch.Tensor, x_out: Optional[torch.Tensor],
               y_out: Optional[torch.Tensor], src: int, send: bool, prev: int, nxt: int,
               transpose: bool, word: int = 0, fold=None,
               keep: Optional[dict] = None, send_first: bool = False,
               what: Optional[str] = None, per_call: tuple = ()) -> None:
    """Launch the chain kernel.  ``fold``: ``(hs, gt)``, the shard's segment summaries and
    their log decays (``gt`` ``None`` ungated), folded in the kernel in place of ``(M,
    d)``; ``d`` then only gives the state's shape and dtype.  ``keep``: a dict where a
    GPU launch leaves its :class:`_Relaunch` (``keep["launch"]``) for calls on the same
    buffers.  ``send_first``: put ``d`` to ``nxt`` before receiving from ``prev`` (a scan
    round, see the kernel).  ``what``: what an error says was awaited (default: the
    state, or its gradient); ``per_call``: pointer parameters a kept launch takes per call
    (:class:`_Relaunch`)."""
    if d.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"forge: states must be float32 or float64, got {d.dtype}")
    d = d.contiguous()
    B, H, K, V = d.shape
    capturing = d.is_cuda and torch.cuda.is_current_stream_capturing()
    ch, bk, bv = _channel(where, direction, d, kind, allocate=not capturing)
    nseg = 0
    if fold is not None:
        if kind is Kind.DENSE:
            raise ValueError("forge: dense transitions have no folded summaries")
        hs, gt = fold
        nseg = hs.shape[0]
        kind_code, smi, smj = (0 if gt is None else _KIND_CODE[kind]), 0, 0
        d, m_arg = hs, (gt if gt is not None else hs)
    elif M is None or kind is Kind.IDENTITY:
        kind_code, m_arg, smi, smj = 0, d, 0, 0
    else:
        m_arg = M.to(d.dtype).contiguous()
        kind_code = _KIND_CODE[kind]
        smi, smj = (K, 1) if not transpose else (1, K)
    if kind_code == 3 and bk < K:
        raise AssertionError("dense tiles must cover K")
    bound, use_clock, limit = _wait_limit(where, d)
    n_tiles = B * H * triton.cdiv(K, bk) * triton.cdiv(V, bv)
    dummy = d
    values = dict(
        first_ptr=first if first is not None else dummy, d_ptr=d, m_ptr=m_arg,
        x_out_ptr=x_out if x_out is not None else dummy,
        y_out_ptr=y_out if y_out is not None else dummy,
        recv_ptr=ch.recv, send_ptr=ch.send, sig_ptr=ch.sig, ack_ptr=ch.ack, err_ptr=ch.err,
        counter_ptr=ch.counter, me=where.pe(where.rank),
        prev_pe=where.pe(prev) if prev >= 0 else -1,
        next_pe=where.pe(nxt) if nxt >= 0 else -1, limit=limit,
        nbytes=(bk * bv + TRAILER) * d.element_size(), rank_stride=ch.rank_stride,
        sig_rank_stride=ch.sig_rank_stride, word=word, K=K, V=V, stride_mi=smi,
        stride_mj=smj, nseg=nseg, nbh=B * H,
        KIND=kind_code, SRC=src, SEND=send, WRITE_Y=y_out is not None, BK=bk, BV=bv,
        TRANSPORT=where.transport, USE_CLOCK=use_clock, BJ=min(32, bk),
        PREC=_dense_precision(d), FOLD=fold is not None, SEND_FIRST=send_first)
    kernel = _kernel(where.transport)[(n_tiles,)](
        **values, num_warps=8 if bk * bv >= 4096 else 4)
    if what is None:
        what = "the incoming state" if direction == "fwd" else "the state gradient"
    ch.after_launch(where.rank, what, bound, p2p.StatePassTimeout, where.explain)
    # kept only once the call went through (after_launch may raise an earlier error)
    if keep is not None and use_clock and not capturing and hasattr(kernel, "packed_metadata"):
        keep["launch"] = _Relaunch(kernel, _forge_chain_kernel, n_tiles, values, where, what,
                                   bound, ch, per_call)


def pass_along(group, x: torch.Tensor, *, to_next: bool, word: int, what: str,
               keep: Optional[dict] = None) -> torch.Tensor:
    """Every rank of ``group`` puts ``x [B, H, K, V]`` (float32 or float64, the same shape
    on every rank) to its neighbour and returns what its other neighbour put (zeros at the
    chain's start): ``to_next`` sends to rank + 1 and receives from rank - 1, else the
    reverse.  One launch of the chain kernel with no transition, every rank putting its own
    tiles before it waits for the incoming ones (``SEND_FIRST``), so the ranks exchange at
    once, not one after another; no host synchronisation, no host collective.  A
    convolution's halo (:mod:`forge_dist.nn.halo`).

    ``word``: the call's signature word (:func:`.agreement.agree`), checked on the device
    against the sender's; ``what``: what an error says was awaited.  ``keep``: a dict the
    caller keeps per shape, where the GPU launch stays for later calls (:class:`_Relaunch`,
    with ``x`` and the result passed per call)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    relaunch = keep.get("launch") if keep is not None else None
    if relaunch is not None and relaunch.usable(d_ptr=x, x_out_ptr=out):
        relaunch(d_ptr=x, x_out_ptr=out)
        return out
    where = _where(group)
    rank, size = where.rank, where.size
    prev, nxt = (rank - 1, rank + 1) if to_next else (rank + 1, rank - 1)
    has_prev, has_next = 0 <= prev < size, 0 <= nxt < size
    _run_chain(where, "halo" if to_next else "halo_bwd", Kind.IDENTITY, None, None, x, out,
               None, _SRC_RECV if has_prev else _SRC_ZERO, has_next,
               prev if has_prev else -1, nxt if has_next else -1, transpose=False, word=word,
               keep=keep, send_first=True, what=what, per_call=("d_ptr", "x_out_ptr"))
    return out


def _pe_table(where: _Where, ranks: tuple, device) -> torch.Tensor:
    """``[len(ranks)]`` int64 on ``device``: the PE of each group rank in ``ranks``, kept on
    ``where`` (which lives as long as its group)."""
    tables = where.__dict__.setdefault("pe_tables", {})
    key = (ranks, str(device))
    t = tables.get(key)
    if t is None:
        t = tables[key] = torch.tensor([where.pe(r) for r in ranks], dtype=torch.int64,
                                       device=device)
    return t


def run_scan_rounds(group, direction: str, kind: Kind, M: Optional[torch.Tensor],
                    d: torch.Tensor, x_out: torch.Tensor, pos: int, size: int,
                    ranks: tuple, word: int = 0, keep: Optional[dict] = None,
                    log_m: bool = False, segments: bool = False) -> None:
    """Every round of the log-depth scan in one launch of :func:`_scan_rounds_kernel`:
    ``x_out [B, H, K, V]`` gets the ``d`` of the maps at positions ``0 .. pos - 1`` composed
    (zeros at position 0), this rank holding position ``pos``'s map ``(M, d)``; ``ranks``:
    the group rank at each position.  Identity, scalar (``M [B, H]``) and diagonal (``M [B,
    H, K]``) transitions, or with ``log_m`` their log decays ``[B, H, K]``; ``M`` ``None``:
    no round reads this position's.  ``segments``: ``d`` is the shard's segment summaries
    ``hs [n_seg, B, H, K, V]`` and ``M`` their log decays ``gt [n_seg, B, H, K]`` (``None``
    for the identity), folded in the kernel (a plan's forward: no launch before it folds
    them).
    ``keep``: a plan's dict, where the launch is kept after its first call
    (:class:`_Relaunch`; then ``M``, ``d`` and ``x_out`` must be buffers the plan rewrites
    in place every call)."""
    if kind is Kind.DENSE:
        raise ValueError("forge: the fused scan carries identity, scalar and diagonal "
                         "transitions (dense ones take the scan's per-round moves)")
    if d.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"forge: states must be float32 or float64, got {d.dtype}")
    kept_key = f"scan-launch-{direction}"
    buffers = (d.data_ptr(), x_out.data_ptr(), 0 if M is None else M.data_ptr())
    relaunch = keep.get(kept_key) if keep is not None else None
    if relaunch is not None and relaunch.buffers == buffers and relaunch.usable():
        relaunch()
        return
    where = _where(group)
    d = d.contiguous()
    nseg = d.shape[0] if segments else 1
    B, H, K, V = x_out.shape
    if segments and (d.dim() != 5 or tuple(d.shape[1:]) != (B, H, K, V)):
        raise ValueError(f"forge: segments: d must be [n_seg, {B}, {H}, {K}, {V}] (x_out's "
                         f"shape after n_seg), got {tuple(d.shape)}")
    if segments and kind is not Kind.IDENTITY and M is None:
        raise ValueError("forge: segments: a decaying kind's segments need their log decays "
                         "M [n_seg, B, H, K] to be folded")
    rounds = max(1, (size - 1).bit_length())
    capturing = d.is_cuda and torch.cuda.is_current_stream_capturing()
    ch, bk, bv = _channel(where, f"scan-{direction}", x_out, kind, allocate=not capturing,
                          slots=rounds, m_rows=True)
    bound, use_clock, limit = _wait_limit(where, d)
    n_tiles = B * H * triton.cdiv(K, bk) * triton.cdiv(V, bv)
    has_m = M is not None and kind is not Kind.IDENTITY
    values = dict(
        d_ptr=d, x_out_ptr=x_out,
        m_ptr=(M.contiguous() if log_m or segments else M.to(d.dtype).contiguous())
        if has_m else d,
        pe_ptr=_pe_table(where, tuple(ranks), d.device),
        recv_ptr=ch.recv, send_ptr=ch.send, sig_ptr=ch.sig, ack_ptr=ch.ack, err_ptr=ch.err,
        counter_ptr=ch.counter, me=where.pe(where.rank), pos=pos, size=size, limit=limit,
        nbytes=(bk * (bv + 1) + TRAILER) * d.element_size(), rank_stride=ch.rank_stride,
        sig_rank_stride=ch.sig_rank_stride, word=word, K=K, V=V, n_tiles=n_tiles,
        nseg=nseg, nbh=B * H,
        KIND=_KIND_CODE[kind], HAS_M=has_m, M_LOG=has_m and log_m, ROUNDS=rounds, BK=bk,
        BV=bv,
        TRANSPORT=where.transport, USE_CLOCK=use_clock)
    if segments:  # set only when on (the same compiled kernel as before the flag existed)
        values["FOLD"] = True
    kernel = _scan_kernel(where.transport)[(n_tiles,)](
        **values, num_warps=8 if bk * bv >= 4096 else 4)
    what = "the incoming state (scan)" if direction == "fwd" else "the state gradient (scan)"
    ch.after_launch(where.rank, what, bound, p2p.StatePassTimeout, where.explain)
    if keep is not None and use_clock and not capturing and hasattr(kernel, "packed_metadata"):
        relaunch = keep[kept_key] = _Relaunch(kernel, _scan_rounds_kernel, n_tiles, values,
                                              where, what, bound, ch)
        relaunch.buffers = buffers  # what it was bound to (a relaunch must see the same)


def flush(wait: bool = True) -> None:
    """Raise :class:`StatePassTimeout` if a finished forge call left an error (lazy mode).

    Channels dropped by :func:`reset` are read too when a CUDA graph captured on them may
    still be replayed (a replay keeps the channels it was captured with)."""
    for ch in [*_CHANNELS.values(), *(c for c in _RETIRED if c.captured)]:
        ch.poll(-1, "a state tile", p2p.timeout_seconds(), p2p.StatePassTimeout, wait=wait)


_RETIRED: list = []  # channels dropped by reset(): never freed (a free is a collective)


def reset(group=None) -> None:
    """Forget every forge channel (of ``group``, or all): the next call allocates fresh ones.

    After a :class:`StatePassTimeout` the ranks' channels are out of step (one rank made a
    call its peer never made), so every later call would time out too.  Call this on every
    rank of the group (the next call's allocation is a collective, like any first call),
    after the ranks have agreed to go on (for example with a barrier on a fresh process
    group).  Pending error records are dropped; the old symmetric buffers stay allocated, so
    a peer's late put lands in memory nobody reads.  A CUDA graph captured before the reset
    still replays on the old channels; :func:`flush` keeps reading their error flags.
    """
    global _RESETS
    _RESETS += 1  # plans' kept launches hold the old channels: they relaunch through the JIT
    name = None if group is None else (getattr(group, "group_name", None) or id(group))
    for key in list(_CHANNELS):
        if name is None or key[-1] == name:
            ch = _CHANNELS.pop(key)
            ch.err.zero_()
            # a copy still in flight may rewrite the old pinned words: drop them (PyTorch's
            # pinned allocator keeps the block until its copies are done)
            ch._err_host = ch._err_words = None  # the records of calls before the reset are dropped, not re-raised
            _RETIRED.append(ch)


class Forge(Strategy):
    """GPU-initiated, tile-fused state pass over NVSHMEM (or the simulated transport)."""

    name = "forge"

    def available(self, device: torch.device) -> Optional[str]:
        device = torch.device(device)
        if device.type != "cuda":
            if interpreted():  # the simulated transport across processes (tests)
                return None
            return (f"forge needs CUDA tensors (NVSHMEM puts from the GPU), got {device}; "
                    f"on the CPU it runs the simulated transport under Triton's interpreter "
                    f"(TRITON_INTERPRET=1 before importing forge_dist)")
        return nvshmem.unavailable_reason()

    def forward_chain(self, kind, M, delta, S0, group, word=0, keep=None):
        where = _where(group)
        rank, size = where.rank, where.size
        if size == 1:
            return S0, None
        if rank < size - 1 and M is None and kind is not Kind.IDENTITY:
            raise ValueError(f"forge: rank {rank} needs its transition M ({kind.value})")
        S_in = S0 if rank == 0 else torch.empty_like(delta, memory_format=torch.contiguous_format)
        _run_chain(where, "fwd", kind, M, S0.contiguous() if rank == 0 else None, delta,
                   None if rank == 0 else S_in, None,
                   _SRC_FIRST if rank == 0 else _SRC_RECV, rank < size - 1,
                   rank - 1, rank + 1 if rank < size - 1 else -1, transpose=False, word=word)
        return S_in, None

    plan_summary = "segments"  # the plan's state pass folds the summaries in the kernel

    def plan_forward(self, kind, summaries, S0, S_in, group, word=0, keep=None,
                     zero_start=False):
        """One chain launch per rank (see :meth:`.base.Strategy.plan_forward`): rank 0 sends
        ``M S0 + delta``, a middle rank receives into ``S_in`` and sends on, the last rank
        only receives.  ``summaries``: ``hs`` and (gated) ``gt``, the program's segment
        summaries, folded into ``(M, delta)`` by the kernel (the delta rule: ``delta`` and
        ``M``, read as they are; a folded summary, hgrn's: ``delta`` and the log decays
        ``cg``, whose last row is the shard's, folded as one segment).  ``keep``: the plan's dict
        for the launch kept after the first call (:class:`_Relaunch`)."""
        relaunch = keep.get("launch") if keep is not None else None
        if relaunch is not None:
            first = S0 if relaunch.where.rank == 0 else None
            if relaunch.usable(first_ptr=first):
                relaunch(first_ptr=first)
                return S0 if first is not None else S_in
        where = _where(group)
        rank, size = where.rank, where.size
        last = rank == size - 1
        M, d, fold = None, S_in, None  # the last rank only receives
        if not last and kind is Kind.DENSE:
            # no segments: the program's delta and M (rank 0 from zero: delta alone, sent
            # as M S0 + delta with S0 = 0 and no product)
            M, d = summaries.get("M"), summaries["delta"]
            if M is None and rank > 0:
                raise ValueError(f"forge: rank {rank} needs its transition M (dense)")
        elif not last and "delta" in summaries and "cg" in summaries:
            # a folded summary (hgrn's): the shard's state and its log decay, as one segment
            fold = (summaries["delta"][None], summaries["cg"][-1:])
        elif not last:
            fold = (summaries["hs"], summaries.get("gt"))
        _run_chain(where, "fwd", kind, M, S0 if rank == 0 else None, d,
                   None if rank == 0 else S_in, None,
                   _SRC_FIRST if rank == 0 else _SRC_RECV, not last,
                   rank - 1, -1 if last else rank + 1, transpose=False, word=word, fold=fold,
                   keep=keep)
        return S0 if rank == 0 else S_in

    def backward_chain(self, kind, M, grad_in, group, saved, word=0, keep=None):
        where = _where(group)
        rank, size = where.rank, where.size
        lam_next = torch.empty_like(grad_in, memory_format=torch.contiguous_format)
        lam_here = torch.empty_like(grad_in, memory_format=torch.contiguous_format)
        if size == 1:
            lam_next.zero_()
            lam_here.copy_(grad_in)
            return lam_next, lam_here
        last = rank == size - 1
        _run_chain(where, "bwd", kind, M, None, grad_in, lam_next, lam_here,
                   _SRC_ZERO if last else _SRC_RECV, rank > 0,
                   rank + 1 if not last else -1, rank - 1, transpose=True, word=word)
        return lam_next, lam_here


FORGE = register(Forge())

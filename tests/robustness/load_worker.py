"""Rank functions for test_load.py: back-to-back calls, and bytes allocated by state passes."""
from __future__ import annotations

import gc
import statistics
import itertools
import os
import sys
import time
import tracemalloc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge_dist import selftest
from forge_dist.sp import base as sp_base
from forge_dist.variants.transitions import Kind

SHAPES = [  # (op, strategy, T_local, dims, varlen, backward)
    ("gla", "lasp2", 8, (4, 4, 4), False, True),
    ("simple_gla", "serial", 16, (8, 5, 4), True, False),
    ("gated_delta_rule", "pipelined", 12, (6, 8, 4), False, True),
    ("hgrn", "serial", 20, (4, 4, 7), True, True),
    ("linear_attn", "pipelined", 9, (5, 3, 4), True, False),
    ("gated_delta_rule", "lasp2", 16, (8, 8, 4), True, True),
    ("simple_gla", "pipelined", 24, (4, 6, 4), False, False),
]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one_call(op, strategy, T_local, dims, varlen, backward, group, seed):
    """One op call on this rank's shard, checked against this process's own single-rank
    run of the same global problem (a stale state from an earlier call would show)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    T = T_local * world
    full, cu = selftest._problem(op, T, T_local, torch.float64, "cpu", seed, varlen, dims)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    mine = {k: (v[:, sl] if k != "initial_state" else v).clone().requires_grad_(backward)
            for k, v in full.items()}
    o, _ = selftest.call_op(op, mine, cu_seqlens=cu, group=group, strategy=strategy)
    ref = {k: v.clone().requires_grad_(backward) for k, v in full.items()}
    o_ref, _ = selftest.call_op(op, ref, cu_seqlens=cu)
    err = selftest.rel_err(o, o_ref[:, sl])
    if backward:
        o.square().sum().backward()
        o_ref[:, sl].square().sum().backward()
        key = "x" if op == "hgrn" else "q"
        err = max(err, selftest.rel_err(mine[key].grad, ref[key].grad[:, sl]))
    return err


class _CountOps(TorchDispatchMode):
    """Number of aten ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _work(shape, group, seed) -> dict:
    """Python function calls and aten ops of one call: a deterministic measure of the work a
    call does (unlike its wall time on a shared CI machine).  A call that does more work as
    calls accumulate (a growing registry scanned, hooks piling up) shows here."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    gc.collect()
    gc.disable()  # a collection's finalisers would count as this call's work
    try:
        with _CountOps() as ops:
            sys.setprofile(profile)
            try:
                _one_call(*shape, group, seed=seed)
            finally:
                sys.setprofile(None)
    finally:
        gc.enable()
    return {"py_calls": calls, "aten_ops": ops.ops}


def load(me, calls: int, warmup: int):
    """``calls`` back-to-back calls cycling through SHAPES; returns timing / memory records
    and, for each shape, the work of one call right after warm-up and one at the end."""
    tracemalloc.start()
    cycle = itertools.cycle(SHAPES)
    records, worst = [], 0.0
    base_rss = base_py = None
    for i in range(calls):
        shape = next(cycle)
        t0 = time.perf_counter()
        worst = max(worst, _one_call(*shape, me.group, seed=i))
        dt = time.perf_counter() - t0
        if i + 1 == warmup:
            tracemalloc.stop()  # the work samples below must not count toward the heap
            for _ in range(2):  # the first pass fills the counting mode's own caches
                work_early = [_work(s, me.group, seed=j) for j, s in enumerate(SHAPES)]
            tracemalloc.start()
            gc.collect()
            # after the samples: the counting mode imports torch modules on first use
            # (tens of MB of RSS once, which importing forge_dist no longer pulls in early)
            base_rss, base_py = _rss_bytes(), tracemalloc.get_traced_memory()[0]
        records.append(dt)
    gc.collect()
    end_rss, end_py = _rss_bytes(), tracemalloc.get_traced_memory()[0]
    work_late = [_work(s, me.group, seed=j) for j, s in enumerate(SHAPES)]
    n = len(SHAPES) * max(1, (calls - warmup) // (4 * len(SHAPES)))
    early, late = records[warmup:warmup + n], records[-n:]
    return {"calls": calls, "warmup": warmup, "max_rel_err": worst,
            # medians: the windows hold the same shape mix, and one scheduler hiccup on a
            # loaded 2-core CI machine must not read as a slow-down
            "early_ms": 1e3 * statistics.median(early), "late_ms": 1e3 * statistics.median(late),
            "work_early": work_early, "work_late": work_late,
            "rss_warm_mb": base_rss / 2**20, "rss_end_mb": end_rss / 2**20,
            "py_heap_warm_kb": base_py / 1024, "py_heap_end_kb": end_py / 1024,
            "window": n}


class _CountAllocs(TorchDispatchMode):
    """Bytes of every new tensor storage created by aten ops while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        seen = set()
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view():
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in seen and id(st) not in inputs and func not in _NO_ALLOC:
                    seen.add(key)
                    self.bytes += st.nbytes()
        return out


_NO_ALLOC = set()


def state_pass_bytes(me, kinds=("scalar", "dense")):
    """{kind: {strategy: bytes}} allocated on this rank by a forward + backward chain."""
    return {kind: _state_pass_bytes(me, kind) for kind in kinds}


def _state_pass_bytes(me, kind: str, B=1, H=4, K=32, V=32):
    rank = me.rank
    kind = Kind(kind)
    gen = torch.Generator().manual_seed(rank)
    M = {Kind.SCALAR: torch.rand(B, H, generator=gen),
         Kind.DENSE: torch.randn(B, H, K, K, generator=gen) / K}[kind]
    delta = torch.randn(B, H, K, V, generator=gen)
    S0 = torch.randn(B, H, K, V, generator=gen) if rank == 0 else torch.zeros(B, H, K, V)
    out = {}
    for name in ("serial", "pipelined", "lasp2"):
        strat = sp_base._REGISTRY[name]
        strat.forward_chain(kind, M, delta, S0, me.group)  # warm up (buffers, pairs)
        with _CountAllocs() as count:
            S_in, saved = strat.forward_chain(kind, M, delta, S0, me.group)
            strat.backward_chain(kind, M, delta.clone(), me.group, saved)
        out[name] = count.bytes
    out["state_bytes"] = delta.numel() * delta.element_size()
    return out

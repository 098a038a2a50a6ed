"""Rank functions for test_faults.py (module level, so spawned processes can import them)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from forge_dist import ops
from forge_dist.sp import base as sp_base
from forge_dist.sp import p2p

BOUND = 1.5               # FORGE_DIST_TIMEOUT in these worlds
STALL = BOUND + 2.0       # a stalled rank sleeps this long
T_LOCAL = 8


def problem(world: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = world * T_LOCAL

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    return {"q": randn(1, T, 2, 8), "k": randn(1, T, 2, 8), "v": randn(1, T, 2, 8),
            "g": torch.nn.functional.logsigmoid(randn(1, T, 2) + 2)}


def call(t, rank, group, strategy, *, T_local=T_LOCAL, grad=False):
    """simple_gla on this rank's shard; with ``grad`` also runs backward; returns o, grads."""
    sl = slice(rank * T_local, (rank + 1) * T_local)
    mine = {k: v[:, sl].clone().requires_grad_(grad) for k, v in t.items()}
    o, _ = ops.simple_gla(mine["q"], mine["k"], mine["v"], mine["g"], group=group,
                          strategy=strategy)
    if grad:
        o.square().sum().backward()
    return o


def recovered_error(me, group, world_rank: int, world: int, strategy: str) -> float:
    """After a new group: max relative error of o (and dq) against one process."""
    t = problem(world, seed=1)
    sl = slice(world_rank * T_LOCAL, (world_rank + 1) * T_LOCAL)
    full = {k: v.clone().requires_grad_() for k, v in t.items()}
    o_ref, _ = ops.simple_gla(full["q"], full["k"], full["v"], full["g"])
    o_ref.square().sum().backward()
    mine = {k: v[:, sl].clone().requires_grad_() for k, v in t.items()}
    o, _ = ops.simple_gla(mine["q"], mine["k"], mine["v"], mine["g"], group=group,
                          strategy=strategy)
    o.square().sum().backward()
    errs = [(o - o_ref[:, sl]).norm() / o_ref[:, sl].norm(),
            (mine["q"].grad - full["q"].grad[:, sl]).norm() / full["q"].grad[:, sl].norm()]
    return float(max(errs))


@contextmanager
def patched(obj, name, make):
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def _misbehave(action):
    if action == "stall":
        time.sleep(STALL)
    else:
        time.sleep(0.3)  # let what was already sent leave the socket, then die
        os._exit(17)


def _fault(scn, rank):
    """A context manager injecting ``scn``'s fault on this rank (or doing nothing).

    ``where``: "before" (the op call), "fwd" / "bwd" (the start of the state pass of
    forward / backward), "tile" (before sending tile ``scn["tile"]`` of the pipelined
    stream); "never" and "validate" are handled by the caller."""
    if rank != scn["rank"] or scn["where"] in ("never", "validate"):
        return patched(os, "getpid", lambda orig: orig)  # no-op
    action, where = scn["action"], scn["where"]
    if where == "before":  # right before the op call (this is called as the call starts)
        _misbehave(action)
        return patched(os, "getpid", lambda orig: orig)  # no-op
    if where in ("fwd", "bwd"):
        strat = sp_base._REGISTRY[scn["strategy"]]
        attr = "forward_chain" if where == "fwd" else "backward_chain"

        def make(orig):
            def wrapper(*a, **kw):
                _misbehave(action)
                return orig(*a, **kw)
            return wrapper
        return patched(strat, attr, make)
    # "tile": misbehave before sending tile scn["tile"] of the pipelined forward stream
    count = {"n": 0}

    def make(orig):
        def wrapper(*a, **kw):
            if count["n"] == scn["tile"]:
                _misbehave(action)
            count["n"] += 1
            return orig(*a, **kw)
        return wrapper
    return patched(p2p, "isend", make)


def run_scenarios(me, scenarios):
    """Every scenario on a fresh group, then a recovery check on another fresh group."""
    out = []
    for i, scn in enumerate(scenarios):
        group = me.join(f"s{i}")
        t = problem(me.size)
        rec = {"name": scn["name"]}
        start = time.monotonic()
        try:
            with _fault(scn, me.rank):
                if scn["where"] == "never" and me.rank == scn["rank"]:
                    time.sleep(STALL)  # this rank never makes the call
                    raise RuntimeError("injected: never called the op")
                T_local = 0 if scn["where"] == "validate" and me.rank == scn["rank"] else T_LOCAL
                call(t, me.rank, group, scn["strategy"], T_local=T_local,
                     grad=scn["where"] == "bwd")
            rec["error"] = None
        except Exception as err:  # noqa: BLE001
            rec["error"] = f"{type(err).__name__}: {err}"
        rec["elapsed"] = time.monotonic() - start
        group = me.join(f"r{i}")
        rec["recovered_err"] = recovered_error(me, group, me.rank, me.size, scn["strategy"])
        out.append(rec)
    return out


def crash_then_regroup(me, scn, survivors):
    """``scn`` crashes one rank; the ``survivors`` form a smaller world and run again."""
    t = problem(me.size)
    rec = {"name": scn["name"]}
    start = time.monotonic()
    try:
        with _fault(scn, me.rank):
            call(t, me.rank, me.group, scn["strategy"], grad=scn["where"] == "bwd")
        rec["error"] = None
    except Exception as err:  # noqa: BLE001
        rec["error"] = f"{type(err).__name__}: {err}"
    rec["elapsed"] = time.monotonic() - start
    new_rank = survivors.index(me.rank)
    group = me.join("survivors", rank=new_rank, size=len(survivors))
    rec["recovered_err"] = recovered_error(me, group, new_rank, len(survivors), scn["strategy"])
    return rec

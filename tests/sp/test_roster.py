"""Naming the rank missing from a failed collective (``forge_dist.sp.p2p._Roster``).

An all-gather has no single peer to blame, so after one fails the rank looks in the group's
store: a peer whose process exited is named at once; else the peers that did not write the
roll-call key of the same collective are named after a short wait.  These tests drive the
roster on an in-memory store (no world), plus one gloo world that checks that a healthy
group's calls touch the store only once (the steady state makes no store traffic at all).
The tests with real dying ranks are in tests/robustness/test_faults.py.
"""
import json
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from forge_dist.sp import p2p

from .distributed import run_world

WHAT = "the forward state summaries (lasp2's all-gather)"


def _roster(rank=0, size=3, procs=None, store=None):
    roster = p2p._Roster(store if store is not None else dist.HashStore(), rank, size, epoch=2)
    roster.procs = procs
    return roster


def _alive():
    return p2p._this_process()


def _dead():
    """The description of a process of this machine that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    info = {"machine": p2p._this_machine(), "pid": proc.pid, "start": None}
    proc.wait()
    return info


def test_a_dead_peer_is_named_at_once():
    dead = _dead()
    roster = _roster(procs={1: _alive(), 2: dead})
    start = time.monotonic()
    source, note = roster.diagnose(5, WHAT, bound=30.0)  # a roll call would wait 3 s
    assert source == "rank 2"
    assert f"rank 2 died: its process, pid {dead['pid']} on this machine, has exited" in note
    assert time.monotonic() - start < 1.0


def test_exited_tells_a_zombie_a_reused_pid_and_another_machine():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        info = {"machine": p2p._this_machine(), "pid": proc.pid, "start": None}
        deadline = time.monotonic() + 30
        while p2p._proc_stat(proc.pid)[0] != "Z":  # exited, not yet reaped by its parent
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert p2p._exited(info) is True
    finally:
        proc.wait()
    me = _alive()
    assert p2p._exited(me) is False
    assert p2p._exited({**me, "start": "1"}) is True  # this pid, but a later process
    assert p2p._exited({**me, "machine": "another host|boot|ns"}) is None
    assert p2p._exited(None) is None


def test_a_live_peer_that_did_not_report_is_named_after_the_roll_call():
    store = dist.HashStore()
    roster = _roster(procs={1: _alive(), 2: _alive()}, store=store)
    store.append(roster.key("roll", 5), "1 ")  # rank 1 failed in this collective too
    store.append(roster.key("roll", 4), "2 ")  # rank 2: in another collective,
    store.append(p2p._Roster(store, 0, 3, epoch=1).key("roll", 5), "2 ")  # incarnation
    start = time.monotonic()
    source, note = roster.diagnose(5, WHAT, bound=1.5)
    assert source == "rank 2"
    assert note == (" (rank 2 is alive but did not reach this collective: it raised earlier, "
                    "stalled or is making other calls)")
    assert time.monotonic() - start >= p2p._roll_call_s(1.5)
    assert store.get(roster.key("roll", 5)).split() == [b"1", b"0"]  # this rank reported


def test_peers_on_another_machine_are_named_when_they_do_not_report():
    elsewhere = {"machine": "another host|boot|ns", "pid": 1, "start": None}
    roster = _roster(size=4, procs={1: elsewhere, 2: elsewhere})  # rank 3 never enrolled
    source, note = roster.diagnose(1, WHAT, bound=1.0)
    assert source == "ranks 1, 2 and 3"
    assert note.startswith(" (ranks 1, 2 and 3 did not reach this collective, or report a "
                           "failure in it within 1s: they died")


def test_a_peer_that_failed_before_its_first_collective_is_found_in_the_store():
    store = dist.HashStore()
    roster = _roster(size=2, procs=None, store=store)  # procs not read: no collective passed
    store.append(roster.key("procs"), json.dumps({"rank": 1, **_dead()}) + "\n")
    assert roster.diagnose(1, WHAT, bound=30.0)[0] == "rank 1"


def test_when_every_peer_reported_this_rank_came_late():
    store = dist.HashStore()
    roster = _roster(procs={}, store=store)
    for r in (1, 2):
        store.append(roster.key("roll", 3), f"{r} ")
    source, note = roster.diagnose(3, WHAT, bound=30.0)
    assert source == "the other ranks"
    assert "ranks 1 and 2 failed in this collective too" in note


class _BrokenStore:
    """A store whose host is gone: every operation fails."""

    def __getattr__(self, name):
        def fail(*a, **k):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_dead_peer_is_named_when_the_store_is_gone_too():
    roster = _roster(procs={1: _alive(), 2: _dead()}, store=_BrokenStore())
    assert roster.diagnose(2, WHAT, bound=30.0)[0] == "rank 2"
    roster = _roster(procs={1: _alive(), 2: _alive()}, store=_BrokenStore())
    source, note = roster.diagnose(2, WHAT, bound=30.0)
    assert source == "the other ranks"
    assert "the group's store failed too, RuntimeError: Connection reset by peer" in note


class _HangingStore:
    def __init__(self):
        self.release = threading.Event()

    def __getattr__(self, name):
        def hang(*a, **k):
            self.release.wait()
            raise RuntimeError("released")
        return hang


def test_a_store_that_never_answers_does_not_hold_the_error_up(monkeypatch):
    monkeypatch.setattr(p2p, "_STORE_SLACK_S", 0.2)
    store = _HangingStore()
    start = time.monotonic()
    try:
        source, note = _roster(procs={}, store=store).diagnose(1, WHAT, bound=1.0)
    finally:
        store.release.set()
    assert time.monotonic() - start < p2p._roll_call_s(1.0) + 1.0
    assert source == "the other ranks" and "the store did not answer" in note


@pytest.mark.parametrize("ranks,text", [([3], "rank 3"), ([0, 2], "ranks 0 and 2"),
                                        (list(range(10)), "ranks 0, 1, 2, 3, 4, 5, 6 and 7 "
                                                          "(10 ranks)")])
def test_ranks_are_listed_readably(ranks, text):
    assert p2p._ranks(ranks) == text


class _CountingStore:
    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


def _store_traffic(group):
    """Store operations of this module over a group's first lasp2 call and three more."""
    import torch

    from forge_dist import ops

    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(rank)
    x = [torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
         for _ in range(3)]
    g = torch.nn.functional.logsigmoid(torch.randn(1, 8, 2, generator=gen,
                                                   dtype=torch.float64) + 2)

    def call():
        o, _ = ops.simple_gla(*x, g, group=group, strategy="lasp2")
        o.square().sum().backward()
    roster = p2p._ROSTERS.get(group)
    assert roster is None  # not enrolled before the first use
    call()
    roster = p2p._ROSTERS[group]
    first = roster.collectives
    roster.store = counting = _CountingStore(roster.store)
    for _ in range(3):
        call()
    return {"first": first, "after": roster.collectives, "calls": counting.calls,
            "procs": sorted(roster.procs)}


def test_the_early_read_never_blocks_and_is_left_to_a_failure_in_large_groups():
    small = _roster(size=3, store=_CountingStore(dist.HashStore()))
    small.read_processes()  # no process listed yet: nothing to wait for
    assert small.procs == {} and small.store.calls == ["check"]
    large = _roster(size=p2p._EARLY_READ_MAX + 1, store=_CountingStore(dist.HashStore()))
    large.read_processes()  # every rank of a large group reading every rank: not up front
    assert large.procs == {} and large.store.calls == []


def test_a_healthy_group_makes_no_store_traffic_per_call():
    out = run_world(2, _store_traffic, env={"FORGE_DIST_TIMEOUT": "20"})
    # the first call: the signature exchange, then lasp2's forward and backward all-gathers
    assert out["first"] == 3 and out["after"] == 3 + 3 * 2
    assert out["calls"] == []  # no store operation in the steady state
    assert out["procs"] == [0, 1]  # the processes were read once, after the first collective

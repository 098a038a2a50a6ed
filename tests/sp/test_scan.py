"""The log-depth strategy (``scan``).

The CPU ranks of the test suite run under Triton's interpreter, where scan takes its
GPU-initiated rounds over the simulated transport (so do the strategy matrix's 2-4 ranks and
the plan tests).  Here: the batched host rounds (``FORGE_DIST_SCAN_ROUNDS=host``) at 5, 8 and
16 gloo ranks against the fp64 recurrence (every op, dense and packed, outputs and every
gradient); ``ceil(log2 P)`` rounds per direction on both paths; and the GPU-initiated rounds with concurrent jittered ranks at 3
and 5 ranks (a rank idle in a round still allocates that round's channel).
"""
import math

import pytest
import torch

from forge_dist.selftest import OPS, run_case, tolerance

from .distributed import run_world


DEVICE_ENV = {"TRITON_INTERPRET": "1", "FORGE_DIST_SIM_JITTER_MS": "3",
              "FORGE_DIST_TIMEOUT": "120"}
HOST = {"FORGE_DIST_SCAN_ROUNDS": "host"}  # the batched host rounds (the tests' CPU ranks
# otherwise take the GPU-initiated rounds over the simulated transport, under the interpreter)


def _errors(group, ops, layouts, T_local):
    return [run_case(op, "scan", torch.float64, varlen, group=group, T_local=T_local).as_dict()
            for op in ops for varlen in layouts]


@pytest.mark.parametrize("world,ops,layouts,T_local", [
    (5, OPS, (False, True), 16),
    (8, OPS, (False, True), 12),
    (16, OPS, (False, True), 8),
], ids=["world5", "world8", "world16"])
def test_scan_matches_the_recurrence(world, ops, layouts, T_local):
    rows, rounds = run_world(world, _errors_and_rounds, ops, layouts, T_local, env=HOST)
    for (fwd, _), (bwd, _), _ in rounds:  # every rank: ceil(log2 P) host rounds each way
        assert fwd == bwd == math.ceil(math.log2(world))
    assert len(rows) == len(ops) * len(layouts)
    for row in rows:
        bad = {k: v for k, v in row["errors"].items() if not v <= tolerance(torch.float64)}
        assert not bad, (row["op"], row["varlen"], bad)
        assert {"o", "final_state", "d_initial_state"} <= set(row["errors"])


def small_simple_gla(group, strategy: str):
    """This rank's ``o`` of a small fp64 simple_gla call (q, k, v require grad)."""
    from forge_dist import ops

    gen = torch.Generator().manual_seed(torch.distributed.get_rank(group))
    q, k, v = (torch.randn(1, 8, 2, 4, generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 8, 2, generator=gen, dtype=torch.float64))
    return ops.simple_gla(q, k, v, g, group=group, strategy=strategy)[0]


def _rounds(group):
    """Per rank, ``((host rounds, device rounds) forward, the same backward)`` of a small
    simple_gla call: host rounds are batched exchanges, device rounds the send-first chain
    launches of a round's state tiles or, fused (``forge.run_scan_rounds``: one launch per
    direction, asserted here), the slots per tile of the channel that launch used, one
    per round."""
    import torch.distributed as dist

    from forge_dist.sp import forge, p2p

    host, device, fused_calls = [], [], []
    real_exchange, real_chain, real_fused = p2p.exchange, forge._run_chain, forge.run_scan_rounds

    def exchange(*args, **kwargs):
        host.append(args[-1])
        return real_exchange(*args, **kwargs)

    def chain(*args, **kwargs):
        if kwargs.get("send_first") and not args[1].endswith("-M"):  # a round's state tiles
            device.append(args[1])
        return real_chain(*args, **kwargs)

    def fused(group, direction, *args, **kwargs):
        fused_calls.append(direction)
        real_fused(group, direction, *args, **kwargs)
        # the channel it ran on: (direction, B, H, K, V, bk, bv, dtype, device, slots, ...)
        slots = {key[9] for key in forge._CHANNELS if key[0] == f"scan-{direction}"}
        assert len(slots) == 1, slots
        device.extend([direction] * slots.pop())
    p2p.exchange, forge._run_chain, forge.run_scan_rounds = exchange, chain, fused
    try:
        o = small_simple_gla(group, "scan")
        fwd = (len(host), len(device))
        o.sum().backward()
    finally:
        p2p.exchange, forge._run_chain, forge.run_scan_rounds = (real_exchange, real_chain,
                                                                 real_fused)
    assert fused_calls in ([], ["fwd", "bwd"]), fused_calls  # none, or one launch each way
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (fwd, (len(host) - fwd[0], len(device) - fwd[1]),
                                 len(fused_calls)), group=group)
    return out


def _errors_and_rounds(group, ops, layouts, T_local):
    return _errors(group, ops, layouts, T_local), _rounds(group)


@pytest.mark.parametrize("world", [2, 3])  # (5, 8 and 16: in test_scan_matches_the_recurrence)
def test_every_rank_takes_ceil_log2_P_host_rounds_each_way(world):
    for (fwd, _), (bwd, _), fused in run_world(world, _rounds, env=HOST):
        assert fwd == bwd == math.ceil(math.log2(world)) and fused == 0


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_launches_log2_P_device_rounds_each_way(world):
    # simple_gla's scalar transition: one launch each way, on a channel of log2 P slots
    for (_, fwd), (_, bwd), fused in run_world(world, _rounds, env=DEVICE_ENV):
        assert fused == 2 and fwd == bwd == int(math.log2(world))




def counting_transfers(run, fused=None):
    """``(run(), forge kernel launches in send-first mode, host point-to-point exchanges)``
    on this rank (what took the GPU-initiated rounds and what went through the host);
    ``fused``: a list that gets the kind of every fused scan launch
    (``forge.run_scan_rounds``)."""
    from forge_dist.sp import forge, p2p

    launches, exchanges = [0], [0]
    real_chain, real_exchange, real_fused = forge._run_chain, p2p.exchange, forge.run_scan_rounds

    def chain(*args, **kwargs):
        launches[0] += kwargs.get("send_first", False)
        return real_chain(*args, **kwargs)

    def exchange(*args, **kwargs):
        exchanges[0] += 1
        return real_exchange(*args, **kwargs)

    def fused_rounds(group, direction, kind, *args, **kwargs):
        if fused is not None:
            fused.append(kind.value)
        return real_fused(group, direction, kind, *args, **kwargs)
    forge._run_chain, p2p.exchange, forge.run_scan_rounds = chain, exchange, fused_rounds
    try:
        out = run()
    finally:
        forge._run_chain, p2p.exchange, forge.run_scan_rounds = (real_chain, real_exchange,
                                                                 real_fused)
    return out, launches[0], exchanges[0]


def _device_errors(group):
    fused = []
    rows, launches, exchanges = counting_transfers(
        lambda: _errors(group, OPS, (False, True), 16), fused)
    return {"rows": rows, "send_first_launches": launches, "host_exchanges": exchanges,
            "fused_kinds": sorted(set(fused))}


@pytest.mark.parametrize("world", [3, 5])
def test_gpu_initiated_rounds_over_the_simulated_transport(world):
    """Every op through scan's GPU-initiated rounds (the dense kind's a launch per round and
    tensor, the others' every round in one launch), concurrent jittered ranks, against the
    fp64 recurrence, forward and every gradient, dense and packed."""
    out = run_world(world, _device_errors, env=DEVICE_ENV)
    assert out["send_first_launches"] > 0 and out["host_exchanges"] == 0, out
    # every non-dense kind went through the fused launch
    assert out["fused_kinds"] == ["diagonal", "identity", "scalar"], out["fused_kinds"]
    for row in out["rows"]:
        bad = {k: v for k, v in row["errors"].items() if not v <= tolerance(torch.float64)}
        assert not bad, (row["op"], row["varlen"], bad)


def _prefixes(kind, maps, omit_unread):
    """Every position's exclusive prefix by :func:`exclusive_scan`, the positions as threads
    that exchange through queues; ``omit_unread``: a position passes ``M=None`` where
    :func:`reads_own_transition` says its rounds never read its transition."""
    import queue
    import threading

    from forge_dist.sp.scan import exclusive_scan, reads_own_transition

    P = len(maps)
    boxes = {(k, p): queue.Queue() for k in range(8) for p in range(P)}
    out = [None] * P

    def position(p):
        M, d = maps[p]
        if omit_unread and not reads_own_transition(kind, p, P):
            M = None

        def exchange(k, src, dst, sent_M, sent_d, m_shape, recv_M):
            if dst < P:
                boxes[(k, dst)].put((sent_M, sent_d))
            if src < 0:
                return None
            r_M, r_d = boxes[(k, p)].get(timeout=30)
            return (r_M if recv_M else None), r_d
        out[p] = exclusive_scan(kind, M, d, p, P, exchange)

    threads = [threading.Thread(target=position, args=(p,)) for p in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("kind_name", ["scalar", "diagonal", "dense"])
def test_a_rank_whose_rounds_never_read_its_transition_may_omit_it(kind_name):
    """``reads_own_transition`` is what scan's plans trust to skip forming a shard's
    transition (rank 0's and, at two ranks, every rank's): every rank's prefix is the same
    with those transitions left out, at every size from 2 to 17, and equals the fp64
    sequential composition."""
    from forge_dist.variants import transitions as tr
    from forge_dist.variants.transitions import Kind

    kind = Kind(kind_name)
    gen = torch.Generator().manual_seed(3)
    B, H, K, V = 1, 2, 3, 2
    for P in range(2, 18):
        maps = []
        for _ in range(P):
            if kind is Kind.SCALAR:
                M = torch.rand(B, H, generator=gen, dtype=torch.float64)
            elif kind is Kind.DIAGONAL:
                M = torch.rand(B, H, K, generator=gen, dtype=torch.float64)
            else:
                M = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64) / K
            maps.append((M, torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)))
        full, lean = _prefixes(kind, maps, False), _prefixes(kind, maps, True)
        S = torch.zeros(B, H, K, V, dtype=torch.float64)
        for p in range(P):
            assert torch.allclose(full[p], S, rtol=1e-12, atol=1e-12), (P, p)
            assert torch.equal(full[p], lean[p]), (P, p)
            S = tr.combine(kind, maps[p][0], S, maps[p][1])
    # the rule omits something: no rank reads it at two ranks, nor rank 0 ever
    from forge_dist.sp.scan import reads_own_transition
    assert not any(reads_own_transition(kind, p, 2) for p in range(2))
    assert not reads_own_transition(kind, 0, 16) and reads_own_transition(kind, 1, 16)


def test_which_ranks_replay_their_rounds_as_moves_alone():
    """``moves_only``: the ranks whose plan rounds are sends and one receive with nothing
    composed (scan's plans replay those, ``sp/scan.py::_Moves``, on the per-round path the
    dense kind takes on the device; the rule depends only on whether a transition travels,
    so the small cases use the scalar and identity kinds): both ranks at two, rank 0 from
    zero while no round sends a transition, never a rank that combines."""
    from forge_dist.sp.scan import moves_only
    from forge_dist.variants.transitions import Kind

    S, I = Kind.SCALAR, Kind.IDENTITY
    assert moves_only(S, 0, 2, True) and moves_only(S, 1, 2, True)
    assert moves_only(S, 1, 2, False)  # the last rank does not fold rank 0's S0
    assert not moves_only(S, 0, 2, False)  # rank 0 folds its S0 every call
    assert moves_only(S, 0, 3, True) and not moves_only(S, 1, 3, True)  # rank 1 sends M
    assert not moves_only(S, 2, 3, True)  # two arrivals
    assert not moves_only(S, 0, 4, True)  # rank 1 composes rank 0's transition later
    D = Kind.DENSE
    assert moves_only(D, 0, 2, True) and moves_only(D, 1, 2, True)
    assert not moves_only(D, 0, 4, True)
    assert moves_only(I, 0, 16, True)  # no transitions travel for the identity kind
    assert not any(moves_only(I, p, 16, True) for p in range(1, 16))

"""Faults in the forge strategy's simulated transport (CPU, Triton interpreter).

The kernel, tile schedule, epochs, credits and error records are those that run over
NVSHMEM; here a "rank" that stalls is one whose kernel is not launched, and a tile stream
cut in the middle is one whose later tiles' signals never arrive.  On the CPU a wait is
decided in one poll (ranks run in chain order), so errors come at once; on the GPU the same
record is written after FORGE_DIST_TIMEOUT of clock-bounded polling (GPU session)."""

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from forge_dist.comm.sim import SimWorld  # noqa: E402
from forge_dist.sp import forge  # noqa: E402
from forge_dist.sp.p2p import StatePassTimeout  # noqa: E402
from forge_dist.variants import transitions as tr  # noqa: E402
from forge_dist.variants.transitions import Kind  # noqa: E402

pytestmark = pytest.mark.skipif(not forge.interpreted(),
                                reason="forge kernels were built without TRITON_INTERPRET=1")
F = forge.FORGE
B, H, K, V = 1, 2, 16, 128  # scalar kind: BV = 64, so 2 heads x 2 v-tiles = 4 tiles


def _data(P, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Ms = [torch.rand(B, H, generator=gen) * 0.5 + 0.5 for _ in range(P)]
    ds = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
    return Ms, ds, torch.randn(B, H, K, V, generator=gen)


def _fwd(world, r, Ms, ds, S0):
    P = world.size
    return F.forward_chain(Kind.SCALAR, Ms[r] if r < P - 1 else None, ds[r],
                           S0 if r == 0 else torch.zeros_like(S0), world[r])[0]


def _fold(Ms, ds, S0):
    S, ins = S0, []
    for M, d in zip(Ms, ds):
        ins.append(S)
        S = tr.combine(Kind.SCALAR, M, S, d)
    return ins


def _channel(world, direction, rank):
    (key, chans), = [(k, c) for k, c in world._channels.items() if k[0] == direction]
    return chans[rank]


def test_tile_stream_cut_in_the_middle_names_the_first_missing_tile():
    P = 3
    world = SimWorld(P)
    Ms, ds, S0 = _data(P)
    _fwd(world, 0, Ms, ds, S0)
    ch = _channel(world, "fwd", 1)
    assert ch.sig.numel() == 4
    ch.sig[2:] = 0  # tiles 2 and 3 of this call never arrive at rank 1
    t0 = time.monotonic()
    with pytest.raises(StatePassTimeout,
                       match=r"rank 1 gave up after [\d.]+s waiting for the incoming state "
                             r"tile 2 from rank 0 \(call 1\)"):
        _fwd(world, 1, Ms, ds, S0)
    assert time.monotonic() - t0 < 30  # interpreter: one poll, no waiting out the bound
    # Rank 1 forwarded the missing tiles poisoned: rank 2 names rank 1 and the tile at once.
    with pytest.raises(StatePassTimeout, match=r"rank 2: rank 1 forwarded tile 2 of the "
                                               r"incoming state poisoned"):
        _fwd(world, 2, Ms, ds, S0)


def test_rank_that_skips_backward_is_named_by_its_predecessor():
    P = 3
    world = SimWorld(P)
    Ms, ds, S0 = _data(P)
    for r in range(P):
        _fwd(world, r, Ms, ds, S0)
    grads = [torch.randn(B, H, K, V) for _ in range(P)]
    # Rank 2 (the start of the backward chain) never runs its backward kernel.
    with pytest.raises(StatePassTimeout, match=r"rank 1 gave up after [\d.]+s waiting for the "
                                               r"state gradient tile 0 from rank 2"):
        F.backward_chain(Kind.SCALAR, Ms[1], grads[1], world[1], None)


def test_timeout_bound_appears_in_the_message(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_TIMEOUT", "7")
    world = SimWorld(2)
    Ms, ds, S0 = _data(2)
    with pytest.raises(StatePassTimeout, match=r"gave up after 7s .* FORGE_DIST_TIMEOUT"):
        _fwd(world, 1, Ms, ds, S0)


def test_after_a_timeout_a_fresh_world_is_correct_and_the_failed_one_stays_failed():
    """Recovery means a new group: the failed world's epochs have diverged (rank 1 counted
    a call that rank 0 never made), so every later call on it times out again, loudly,
    never silently pairing tiles of different calls."""
    P = 2
    world = SimWorld(P)
    Ms, ds, S0 = _data(P)
    with pytest.raises(StatePassTimeout):
        _fwd(world, 1, Ms, ds, S0)  # rank 0 stalled: it never launched
    for _ in range(2):  # the same world keeps failing loudly
        _fwd(world, 0, Ms, ds, S0)
        with pytest.raises(StatePassTimeout):
            _fwd(world, 1, Ms, ds, S0)
    fresh = SimWorld(P)
    got = [_fwd(fresh, r, Ms, ds, S0) for r in range(P)]
    for g, w in zip(got, _fold(Ms, ds, S0)):
        assert torch.equal(g, w)


def test_consumer_that_lags_past_the_bound_never_takes_a_later_calls_tile():
    """Rank 0 makes calls 1 and 2 before rank 1 makes call 1.  Call 2's credit wait runs out
    (rank 1 has not read call 1's tile), so rank 0 reports it and sends only the poisoned
    signal of call 2, leaving call 1's tile in place.  Rank 1's call 1 then sees a signal of a
    later call and fails with NaN instead of returning either call's tile as its own."""
    P = 2
    world = SimWorld(P)
    Ms, ds, S0 = _data(P)
    _fwd(world, 0, Ms, ds, S0)  # call 1: tile sent
    slot = _channel(world, "fwd", 1).recv.clone()  # call 1's tiles
    S0_next = torch.randn_like(S0)
    with pytest.raises(StatePassTimeout,
                       match=r"rank 0 gave up after [\d.]+s waiting for rank 1 to free its "
                             r"receive slot for the incoming state tile 0 \(call 2\)"):
        _fwd(world, 0, Ms, ds, S0_next)
    # call 2 wrote no data into the slot rank 1 may still be reading
    assert torch.equal(_channel(world, "fwd", 1).recv, slot)
    with pytest.raises(StatePassTimeout,
                       match=r"rank 1: the signal of the incoming state tile 0 from rank 0 "
                             r"already belongs to a later call than this one \(call 1\)"):
        _fwd(world, 1, Ms, ds, S0)
    # the poisoned signal carried no data: call 1's tile is where it was
    assert torch.equal(_channel(world, "fwd", 1).recv, slot)


def test_lagging_consumer_gets_nan_not_a_tile():
    """The same lag, seen through the output: every element of the stale call's S_in is NaN,
    and the failed call still counts on the channel (the epochs stay in step)."""
    P = 2
    world = SimWorld(P)
    Ms, ds, S0 = _data(P)
    _fwd(world, 0, Ms, ds, S0)
    with pytest.raises(StatePassTimeout):
        _fwd(world, 0, Ms, ds, torch.randn_like(S0))
    S_in = torch.full_like(S0, 7.0)
    with pytest.raises(StatePassTimeout):
        forge._run_chain(forge._Where(world[1]), "fwd", Kind.SCALAR, None, None, ds[1], S_in,
                         None, forge._SRC_RECV, False, 0, -1, transpose=False)
    assert torch.isnan(S_in).all()
    assert int(_channel(world, "fwd", 1).counter[0]) == 1

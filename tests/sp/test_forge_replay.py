"""CUDA-graph replay of the forge chain, as the simulated transport sees it (CPU, interpreter).

A graph replays a launch with the very arguments it captured.  Here each rank's first
forward launch is recorded (kernel, grid, arguments) and then re-launched with those same
arguments while the input tensors change in place, which is what ``graph.replay()`` does on
the GPU.  With the epoch on the device every replay is a new call: results follow the new
inputs, and a consumer replayed before its producer reports the missing tile instead of
taking the previous replay's tile (with a host epoch baked into the arguments it would
silently read the stale one).
"""

import pytest
import torch

from forge_dist.comm import channel as chan
from forge_dist.comm.sim import SimWorld
from forge_dist.sp import forge
from forge_dist.variants import transitions as tr
from forge_dist.variants.transitions import Kind

pytestmark = pytest.mark.skipif(
    not forge.interpreted(),
    reason="forge kernels were built before TRITON_INTERPRET=1 was set (run this file with it)")


class _Recorder:
    """Stands in for the kernel: launches it and keeps every launch's arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid, args, kw))
            return self.kernel[grid](*args, **kw)
        return launch

    def replay(self, i):
        grid, args, kw = self.launches[i]
        self.kernel[grid](*args, **kw)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder(forge._forge_chain_kernel)
    monkeypatch.setattr(forge, "_kernel", lambda transport: rec)
    return rec


def _record_forward(world, kind, Ms, deltas, S0s):
    """One eager forward per rank in chain order; returns each rank's ``S_in`` tensor."""
    P = world.size
    return [forge.FORGE.forward_chain(kind, Ms[r] if r < P - 1 else None, deltas[r], S0s[r],
                                      world[r])[0] for r in range(P)]


def _channels(world):
    (chans,) = world._channels.values()
    return chans


@pytest.mark.parametrize("kind", [Kind.SCALAR, Kind.DENSE], ids=lambda k: k.value)
def test_replayed_launches_follow_new_inputs(recorder, kind):
    P, B, H, K, V = 3, 1, 2, 16, 32
    gen = torch.Generator().manual_seed(0)
    world = SimWorld(P)
    Ms = [torch.rand(B, H, generator=gen) * 0.5 + 0.5 if kind is Kind.SCALAR
          else torch.randn(B, H, K, K, generator=gen) / K ** 0.5 for _ in range(P)]
    deltas = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
    S0s = [torch.randn(B, H, K, V, generator=gen)] + [torch.zeros(B, H, K, V)] * (P - 1)
    outs = _record_forward(world, kind, Ms, deltas, S0s)
    assert len(recorder.launches) == P
    for call in range(2, 7):
        for d in deltas:  # new inputs, same tensors: what a graph replay sees
            d.copy_(torch.randn(B, H, K, V, generator=gen))
        S0s[0].copy_(torch.randn(B, H, K, V, generator=gen))
        for r in range(P):
            recorder.replay(r)
        S, want = S0s[0], []
        for r in range(P):
            want.append(S.clone())
            S = tr.combine(kind, Ms[r], S, deltas[r])
        for r in range(1, P):
            err = float((outs[r] - want[r]).norm() / want[r].norm())
            assert err < 1e-5, (call, r, err)
    for ch in _channels(world):
        assert ch.epoch == 6 and int(ch.err[0]) == 0


def test_consumer_replayed_before_its_producer_reports_the_missing_tile(recorder):
    P, B, H, K, V = 2, 1, 2, 16, 16
    world = SimWorld(P)
    M = torch.full((B, H), 0.5)
    d = torch.randn(B, H, K, V)
    S0 = torch.randn(B, H, K, V)
    outs = _record_forward(world, Kind.SCALAR, [M, None], [d, d], [S0, torch.zeros_like(S0)])
    torch.testing.assert_close(outs[1], 0.5 * S0 + d)
    S0.mul_(-3)  # the next replay's input: rank 1 must never see the old S0 again
    recorder.replay(1)  # the consumer runs first: its tiles are not there yet
    consumer = _channels(world)[1]
    code, peer, tile, epoch = consumer.err.tolist()[:4]
    assert (code, peer, epoch) == (chan.ERR_RECV_TIMEOUT, 0, 2), consumer.err
    assert "gave up" in chan.describe_error(consumer.err.tolist(), 1, "the incoming state", 1.0)
    # what it hands on is NaN, never the previous replay's tile
    assert torch.isnan(outs[1]).all()

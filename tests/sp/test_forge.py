"""The forge strategy over the simulated transport (CPU, Triton interpreter).

Ranks share one process (``SimWorld``); each rank's kernel is launched in chain order, the
same kernel source, tile schedule, epochs, credits and error records as over NVSHMEM.
Results are checked against a plain PyTorch fold of ``forge_dist.variants.transitions``.
"""

import pytest
import torch

from forge_dist import sp
from forge_dist.comm.sim import SimWorld
from forge_dist.sp import forge
from forge_dist.sp.p2p import StatePassTimeout
from forge_dist.variants import transitions as tr
from forge_dist.variants.transitions import Kind

pytestmark = pytest.mark.skipif(
    not forge.interpreted(),
    reason="forge kernels were built before TRITON_INTERPRET=1 was set (run this file with it)")

STRAT = forge.FORGE


def _transition(kind, B, H, K, gen, dtype=torch.float32):
    if kind is Kind.IDENTITY:
        return None
    if kind is Kind.SCALAR:
        return torch.rand(B, H, generator=gen, dtype=dtype) * 0.5 + 0.5
    if kind is Kind.DIAGONAL:
        return torch.rand(B, H, K, generator=gen, dtype=dtype) * 0.5 + 0.5
    return torch.randn(B, H, K, K, generator=gen, dtype=dtype) / K ** 0.5


def _forward(world, kind, Ms, deltas, S0):
    P = world.size
    return [STRAT.forward_chain(kind, Ms[r] if r < P - 1 else None, deltas[r],
                                S0 if r == 0 else torch.zeros_like(S0), world[r])[0]
            for r in range(P)]


def _backward(world, kind, Ms, grads):
    P = world.size
    out = {}
    for r in reversed(range(P)):
        out[r] = STRAT.backward_chain(kind, Ms[r] if r < P - 1 else None, grads[r], world[r],
                                      None)
    return [out[r] for r in range(P)]


def _fold_forward(kind, Ms, deltas, S0):
    S, ins = S0, []
    for M, d in zip(Ms, deltas):
        ins.append(S)
        S = tr.combine(kind, M, S, d)
    return ins


def _fold_backward(kind, Ms, grads):
    P = len(grads)
    lam = torch.zeros_like(grads[0])
    out = [None] * P
    for r in reversed(range(P)):
        lam_next = lam
        lam = grads[r] + tr.apply_transposed(kind, Ms[r], lam_next)
        out[r] = (lam_next, lam)
    return out


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_chains_match_fold(kind, P):
    B, H, K, V = 2, 2, 32, 48  # V is cut into a full and a partial tile
    gen = torch.Generator().manual_seed(P * 10 + len(kind.value))
    world = SimWorld(P)
    Ms = [_transition(kind, B, H, K, gen) for _ in range(P)]
    deltas = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
    S0 = torch.randn(B, H, K, V, generator=gen)
    got = _forward(world, kind, Ms, deltas, S0)
    want = _fold_forward(kind, Ms, deltas, S0)
    for r in range(P):
        assert _rel(got[r], want[r]) < 1e-5, (r, _rel(got[r], want[r]))
    grads = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
    got_b = _backward(world, kind, Ms, grads)
    want_b = _fold_backward(kind, Ms, grads)
    for r in range(P):
        assert torch.equal(got_b[r][0], want_b[r][0]) if r == P - 1 else \
            _rel(got_b[r][0], want_b[r][0]) < 1e-5, r
        assert _rel(got_b[r][1], want_b[r][1]) < 1e-5, r


@pytest.mark.parametrize("kind,K,V", [(Kind.DENSE, 24, 40), (Kind.DENSE, 80, 24),
                                      (Kind.DIAGONAL, 80, 1), (Kind.SCALAR, 20, 200)],
                         ids=["dense-odd", "dense-row-blocks", "vector-state", "scalar-wide"])
def test_odd_shapes_and_fp64(kind, K, V):
    """Non-power-of-two heads, an HGRN-like ``[B, 1, D, 1]`` state, and fp64 states.
    ``dense-row-blocks``: K=80 pads to a 128-row tile that the dense combine walks in four
    row blocks of 32, the last one partly masked."""
    P, B, H = 3, 1, 1 if V == 1 else 2
    gen = torch.Generator().manual_seed(7)
    world = SimWorld(P)
    dt = torch.float64
    Ms = [_transition(kind, B, H, K, gen, dt) for _ in range(P)]
    deltas = [torch.randn(B, H, K, V, generator=gen, dtype=dt) for _ in range(P)]
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dt)
    got = _forward(world, kind, Ms, deltas, S0)
    for r, want in enumerate(_fold_forward(kind, Ms, deltas, S0)):
        assert _rel(got[r], want) < 1e-12
    grads = [torch.randn(B, H, K, V, generator=gen, dtype=dt) for _ in range(P)]
    for (gn, gh), (wn, wh) in zip(_backward(world, kind, Ms, grads),
                                  _fold_backward(kind, Ms, grads)):
        assert torch.allclose(gn, wn, rtol=1e-12, atol=1e-12)
        assert torch.allclose(gh, wh, rtol=1e-12, atol=1e-12)


def test_epochs_many_calls_same_buffers():
    """Buffers are reused; each call's signals carry a new epoch, so no call reads stale
    tiles: every call gets its own data back, forward and backward interleaved."""
    P, B, H, K, V = 3, 1, 2, 16, 32
    gen = torch.Generator().manual_seed(3)
    world = SimWorld(P)
    kind = Kind.DIAGONAL
    for call in range(12):
        Ms = [_transition(kind, B, H, K, gen) for _ in range(P)]
        deltas = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
        S0 = torch.randn(B, H, K, V, generator=gen)
        got = _forward(world, kind, Ms, deltas, S0)
        for r, want in enumerate(_fold_forward(kind, Ms, deltas, S0)):
            assert _rel(got[r], want) < 1e-5, (call, r)
        if call % 3 == 0:
            grads = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
            for (gn, gh), (wn, wh) in zip(_backward(world, kind, Ms, grads),
                                          _fold_backward(kind, Ms, grads)):
                assert _rel(gh, wh) < 1e-5, call
    key_epochs = [ch.epoch for chans in world._channels.values() for ch in chans]
    assert sorted(set(key_epochs)) == [4, 12]  # bwd channel: 4 calls, fwd channel: 12


def test_rank_that_never_sends_times_out_on_successor():
    P, B, H, K, V = 3, 1, 2, 16, 16
    world = SimWorld(P)
    M = torch.full((B, H), 0.5)
    d = torch.randn(B, H, K, V)
    S0 = torch.zeros_like(d)
    _forward(world, Kind.SCALAR, [M] * P, [d] * P, S0)  # one good call first
    # Rank 0 skips the second call: rank 1 times out naming itself, rank 0 and a tile...
    with pytest.raises(StatePassTimeout, match=r"rank 1 gave up .* tile \d+ from rank 0"):
        STRAT.forward_chain(Kind.SCALAR, M, d, S0, world[1])
    # ...and forwards poison, so rank 2 reports it at once instead of waiting out the bound.
    with pytest.raises(StatePassTimeout, match=r"rank 2: rank 1 forwarded tile \d+ .*poisoned"):
        STRAT.forward_chain(Kind.SCALAR, None, d, S0, world[2])


def test_producer_waits_for_credit():
    """A producer may not overwrite a receive slot its consumer has not read yet."""
    world = SimWorld(2)
    d = torch.randn(1, 1, 16, 16)
    STRAT.forward_chain(Kind.IDENTITY, None, d, torch.zeros_like(d), world[0])
    with pytest.raises(StatePassTimeout, match=r"rank 0 .* rank 1 to free its receive slot"):
        STRAT.forward_chain(Kind.IDENTITY, None, d, torch.zeros_like(d), world[0])


def test_registered_and_on_the_cpu_only_under_the_interpreter():
    assert "forge" in sp.names()
    # this file runs under the interpreter: CPU tensors take the simulated transport
    assert STRAT.available(torch.device("cpu")) is None
    assert sp.resolve("forge", torch.device("cpu")).name == "forge"
    assert sp.resolve("auto", torch.device("cpu")).name != "forge"  # never picked by auto


def test_auto_picks_forge_for_cuda_tensors_on_one_node(monkeypatch):
    import torch.distributed as dist

    cuda = torch.device("cuda", 0)
    world, sub = object(), object()  # stand-ins: the job's group and a subgroup of it
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is sub else 4)
    monkeypatch.setattr(STRAT, "available", lambda device: None)  # as where NVSHMEM runs
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert sp.resolve("auto", cuda, world).name == "forge"
    assert sp.resolve("auto", cuda).name == "lasp2"  # no group given: not known to be the job
    assert sp.resolve("auto", torch.device("cpu"), world).name == "lasp2"
    # a subgroup (data x sequence parallel): forge's allocations are job-wide collectives
    assert sp.resolve("auto", cuda, sub).name == "lasp2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes: the puts would cross the network
    assert sp.resolve("auto", cuda, world).name == "lasp2"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launch that does not say
    assert sp.resolve("auto", cuda, world).name == "lasp2"
    # priced by the cost model (sp/choice.py) for the group's layout, kind and state
    from forge_dist.sp import layout
    from forge_dist.variants.transitions import Kind as K

    state = (1, 32, 128, 128)
    from forge_dist.sp import choice  # (the model with puts alone: the two layouts differ)

    monkeypatch.setattr(choice, "HOP_SKEW_US", 0.0)
    monkeypatch.setattr(choice, "ROUND_SKEW_US", 0.0)
    for nodes, want in (([[0, 1, 2, 3]], "forge"), ([[0], [1], [2], [3]], "scan")):
        layout.forget()
        monkeypatch.setattr(layout, "nodes", lambda group, nodes=nodes: nodes)
        assert sp.resolve("auto", cuda, world, kind=K.SCALAR, state=state).name == want
    layout.forget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(STRAT, "available", lambda device: "no NVSHMEM here")
    assert sp.resolve("auto", cuda, world).name == "lasp2"
    # nor scan or hier (their rounds would go through the host, which the model does not price)
    assert sp.resolve("auto", cuda, world, kind=K.SCALAR, state=state).name == "lasp2"


def test_bad_inputs():
    world = SimWorld(2)
    d = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="needs its transition M"):
        STRAT.forward_chain(Kind.SCALAR, None, d, torch.zeros_like(d), world[0])
    with pytest.raises(ValueError, match="float32 or float64"):
        STRAT.forward_chain(Kind.IDENTITY, None, d.half(), torch.zeros_like(d).half(),
                            world[0])


def test_a_kept_launch_passes_every_kernel_parameter_in_order():
    """A kept launch (the GPU's, where a plan relaunches the compiled kernel directly) hands
    the launcher every parameter of the kernel in signature order; a constexpr the launch
    left at its default (the scan kernel's FOLD, on a position that folds nothing) takes
    its default.  Without it, the last rank of a scan plan failed on the GPU only."""
    calls = []

    class Compiled:  # what Triton's compiled kernel offers the relaunch
        function, packed_metadata = object(), object()

        def run(self, *args):
            calls.append(args)

    from triton.runtime.jit import JITFunction

    # the kernel as compiled (not interpreted) Triton sees it: its parameters and defaults
    kernel = JITFunction(getattr(forge._scan_rounds_kernel, "fn", forge._scan_rounds_kernel))
    params = kernel.params
    d = torch.zeros(4)
    values = {p.name: (d if p.name == "d_ptr" else i) for i, p in enumerate(params)
              if not p.has_default}
    assert any(p.has_default for p in params)  # the case this checks
    relaunch = forge._Relaunch(Compiled(), kernel, 3, values, None,
                               "the incoming state", 1.0, None)
    relaunch._run(*relaunch._grid, None, None, None, None, None, None, *relaunch._values)
    passed = calls[0][9:]
    assert len(passed) == len(params)
    assert [passed[i] for i, p in enumerate(params) if not p.has_default] == \
        [values[p.name] for p in params if not p.has_default]
    assert [passed[i] for i, p in enumerate(params) if p.has_default] == \
        [p.default for p in params if p.has_default]


def test_a_kept_launch_takes_the_tensors_of_each_call(monkeypatch):
    """A kept chain launch with per-call tensors (a convolution halo's send and receive,
    :func:`forge.pass_along`) puts each call's tensors in their parameters' slots, holds
    none of them after the call, and refuses (``usable``) a tensor that is not aligned as
    the compiled kernel's were."""
    calls = []

    class Compiled:
        function, packed_metadata = object(), object()

        def run(self, *args):
            calls.append(args[9:])

    class Channel:
        def after_launch(self, *args):
            pass

    class Where:
        rank = 0
        explain = None

    from triton.runtime.jit import JITFunction

    kernel = JITFunction(getattr(forge._forge_chain_kernel, "fn", forge._forge_chain_kernel))
    names = [p.name for p in kernel.params]
    first_d = torch.zeros(8)
    values = {p.name: (first_d if p.name.endswith("_ptr") else i)
              for i, p in enumerate(kernel.params)}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0,
                        raising=False)
    from forge_dist.sp import p2p

    relaunch = forge._Relaunch(Compiled(), kernel, 2, values, Where(), "a convolution halo",
                               p2p.timeout_seconds(), Channel(),
                               per_call=("d_ptr", "x_out_ptr"))
    for _ in range(2):
        send, out = torch.zeros(8), torch.zeros(8)
        relaunch(d_ptr=send, x_out_ptr=out)
        passed = calls[-1]
        assert passed[names.index("d_ptr")] is send and passed[names.index("x_out_ptr")] is out
        assert passed[names.index("recv_ptr")] is first_d  # the kept buffers stay
        kept = relaunch._values
        assert not any(v is send or v is out for v in kept)  # nothing of the call is held
    assert relaunch.usable(d_ptr=torch.zeros(8), x_out_ptr=torch.zeros(8))
    assert not relaunch.usable(d_ptr=torch.zeros(9)[1:])  # 4-byte offset

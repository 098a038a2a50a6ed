"""The convolution halo across ranks: values, gradients, packed documents, bad shard sizes."""
import pytest
import torch
import torch.distributed as dist

from forge_dist.nn import ShortConvolution, halo_exchange
from forge_dist.nn.halo import halo_exchanges
from tests.sp.distributed import run_world

from .helpers import gather_tokens, rel_err, sum_ranks
from .test_layers_reference import conv as conv_per_document

# 3 ranks x 4 tokens, kernel 4 (halo 3): documents [0,2) [2,6) [6,7) [7,12) put boundaries
# inside the halo of rank 1 (token 6 starts right after its first halo-covered token) and
# of rank 2 (document [6,7) is one token long and [7,12) starts at rank 2's first token - 1).
CU = torch.tensor([0, 2, 6, 7, 12])
T_LOCAL, D = 4, 5


def _halo_values(group, strategy="auto"):
    rank = dist.get_rank(group)
    x = torch.arange(2 * T_LOCAL * D, dtype=torch.float64).reshape(2, T_LOCAL, D) + 1000 * rank
    x.requires_grad_()
    h = halo_exchange(x, 3, group, strategy)
    expect = (torch.zeros_like(h) if rank == 0 else
              (torch.arange(2 * T_LOCAL * D, dtype=torch.float64).reshape(2, T_LOCAL, D)
               + 1000 * (rank - 1))[:, -3:])
    # backward: weight the halo by (rank + 1); rank r-1's last 3 tokens get that weight
    (h * (rank + 1)).sum().backward()
    world = dist.get_world_size(group)
    g_expect = torch.zeros_like(x)
    if rank < world - 1:
        g_expect[:, -3:] = rank + 2
    return {"values": bool(torch.equal(h.detach(), expect)),
            "grads": bool(torch.equal(x.grad, g_expect))}


def _conv_sp(group):
    rank = dist.get_rank(group)
    out = {}
    for packed in (False, True):
        for act, bias in (("silu", True), (None, False)):
            torch.manual_seed(0)
            m = ShortConvolution(D, 4, bias=bias, activation=act).double()
            gen = torch.Generator().manual_seed(1)
            B = 1 if packed else 2
            cu = CU if packed else None
            x = torch.randn(B, 3 * T_LOCAL, D, generator=gen, dtype=torch.float64)
            w = torch.randn(B, 3 * T_LOCAL, D, generator=gen, dtype=torch.float64)
            x1 = x.clone().requires_grad_()
            y1 = conv_per_document(x1, m, cu, act=act is not None)
            (y1 * w).sum().backward()
            gw1 = m.weight.grad.clone()
            m.zero_grad(set_to_none=True)
            sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
            xs = x[:, sl].clone().requires_grad_()
            y = m(xs, cu_seqlens=cu, group=group)
            (y * w[:, sl]).sum().backward()
            key = f"packed={packed},act={act}"
            out[key] = max(rel_err(gather_tokens(y.detach(), group), y1),
                           rel_err(gather_tokens(xs.grad, group), x1.grad),
                           rel_err(sum_ranks(m.weight.grad, group), gw1))
    return out


def _halos_together(group):
    """Three shards' halos in one exchange equal three exchanges, values and gradients."""
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(2, T_LOCAL, d, generator=gen, dtype=torch.float64) for d in (5, 3, 7)]
    ws = [torch.randn(2, 3, d, generator=gen, dtype=torch.float64) for d in (5, 3, 7)]
    grads = []
    for exchange in (lambda ts: [halo_exchange(t, 3, group) for t in ts],
                     lambda ts: halo_exchanges(ts, 3, group)):
        ts = [x.clone().requires_grad_() for x in xs]
        hs = exchange(ts)
        sum((h * w).sum() for h, w in zip(hs, ws)).backward()
        grads.append(([h.detach() for h in hs], [t.grad for t in ts]))
    (h1, g1), (h2, g2) = grads
    same = torch.tensor(int(all(torch.equal(a, b) for a, b in zip(h1 + g1, h2 + g2))))
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)  # every rank's, not rank 0's
    return bool(same)


def _too_short(group):
    x = torch.zeros(1, 2, 3)
    try:
        halo_exchange(x, 3, group)
    except ValueError as err:
        return str(err)
    return "no error"


def _path_taken(group, strategy="auto"):
    """Which transport the halos took on this rank: the GPU-initiated one leaves its kept
    channel keys in ``halo._KEPT``."""
    from forge_dist.nn import halo

    halo._KEPT.clear()
    x = torch.randn(2, T_LOCAL, D, dtype=torch.float64, requires_grad=True)
    halo_exchange(x, 3, group, strategy).sum().backward()
    # the directions that ran on the device (to_next: True forward, False backward)
    return sorted(k[0] for k in halo._KEPT.get(group, {}))


@pytest.mark.parametrize("mode", ["auto", "p2p"])
def test_halo_values_and_gradients_cross_ranks(mode):
    """The same values and gradients through the GPU-initiated transport (simulated here)
    and through the process group's send and receive."""
    env = {"FORGE_DIST_HALO": mode}
    assert run_world(3, _halo_values, "forge", env=env) == {"values": True, "grads": True}
    # auto with forge: forward (to the next rank) and backward (to the previous) on the
    # device path; auto with auto, which resolves to lasp2 on the CPU: the process group's
    assert run_world(2, _path_taken, "forge", env=env) == \
        ([False, True] if mode == "auto" else [])
    assert run_world(2, _path_taken, "auto", env=env) == []


def test_host_driven_strategies_keep_the_process_groups_halo():
    """A layer whose strategy passes states from the host (serial, pipelined, lasp2) sends
    its halos through the process group too under ``auto``; ``device`` forces the GPU's."""
    assert run_world(2, _path_taken, "lasp2", env={"FORGE_DIST_HALO": "auto"}) == []
    assert run_world(2, _path_taken, "lasp2",
                     env={"FORGE_DIST_HALO": "device"}) == [False, True]


def _other_batch_on_rank_1(group):
    rank = dist.get_rank(group)
    x = torch.zeros(2 + rank, T_LOCAL, D, dtype=torch.float64)
    try:
        halo_exchange(x, 3, group)
    except ValueError as err:  # SignatureMismatch is a ValueError
        return str(err)
    return "no error"


def test_ranks_with_different_halo_shapes_get_a_clear_error():
    """The device path agrees on the halo's shape once per new shape: ranks that disagree
    get an error naming the argument and both values, not a hang."""
    msg = run_world(2, _other_batch_on_rank_1, env={"FORGE_DIST_HALO": "device"})
    assert "B: every rank must pass the same value, but rank 0 has 2 and rank 1 has 3" in msg


def _device_only_on_rank_0(group):
    """Rank 1 lacks the GPU-initiated transport: every rank takes the process group's path
    (auto) or gets the error naming the rank (device), never a mix that would hang."""
    import os

    from forge_dist.nn import halo

    rank = dist.get_rank(group)
    if rank == 1:
        halo._transport_reason = lambda group, device: "stand-in: not on this rank"
    x = torch.arange(2 * T_LOCAL * D, dtype=torch.float64).reshape(2, T_LOCAL, D) + rank
    try:
        h = halo_exchange(x, 3, group)
    except RuntimeError as err:
        return str(err)
    return [os.environ["FORGE_DIST_HALO"], float(h.sum()), len(halo._KEPT)]


def test_a_rank_without_the_transport_takes_every_rank_off_it():
    auto = run_world(2, _device_only_on_rank_0, env={"FORGE_DIST_HALO": "auto"})
    assert auto[0] == "auto" and auto[2] == 0  # rank 0 (which has it) took the p2p path
    msg = run_world(2, _device_only_on_rank_0, env={"FORGE_DIST_HALO": "device"})
    assert "not available for this group's halos (rank(s) [1] of the group" in msg, msg


def test_unknown_halo_mode_is_an_error(monkeypatch):
    from forge_dist.nn import halo

    monkeypatch.setenv("FORGE_DIST_HALO", "nccl")
    with pytest.raises(ValueError, match="FORGE_DIST_HALO must be one of auto, device, p2p, "
                                         "got 'nccl'"):
        halo._mode()


def test_conv_sp3_matches_per_document_conv():
    errs = run_world(3, _conv_sp)
    assert len(errs) == 4
    for key, e in errs.items():
        assert e <= 1e-12, (key, e)


def test_halos_of_several_convolutions_in_one_exchange():
    assert run_world(3, _halos_together) is True


def test_shard_shorter_than_halo_is_an_error():
    msg = run_world(2, _too_short)
    assert "fewer than the convolution halo of 3" in msg


"""``auto``'s choice among the GPU-initiated passes (:mod:`forge_dist.sp.choice`): the routes,
the picks the model makes at the sizes the scaling issue names, that its link parameters are
the cost model's, and that ``resolve("auto")`` takes the model's pick for the group's layout."""
import sys
from pathlib import Path

import pytest

from forge_dist.sp import choice
from forge_dist.variants.transitions import Kind

from .distributed import run_world

B1 = (1, 32, 128, 128)  # B=1, H=32, K=V=128: the short shards
B4 = (4, 32, 128, 128)


def _nodes(P, L):
    return [list(range(i, min(P, i + L))) for i in range(0, P, L)]


def test_routes_count_the_links_each_pass_crosses():
    two_by_four = _nodes(8, 4)
    assert [ln is choice.ACROSS_NODES for ln in choice.route("forge", two_by_four)] == \
        [False, False, False, True, False, False, False]
    assert choice.route("scan", two_by_four) == [choice.ACROSS_NODES] * 3
    assert choice.route("hier", two_by_four) == [choice.IN_NODE] * 2 + \
        [choice.ACROSS_NODES] + [choice.IN_NODE]
    assert choice.route("hier", _nodes(4, 8)) == [choice.IN_NODE] * 2  # one node: the scan
    with pytest.raises(ValueError, match="strategy: expected one of"):
        choice.route("ring", two_by_four)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("state", [B1, B4])
def test_the_chain_up_to_four_ranks_a_log_depth_pass_beyond(kind, state):
    # every further hop or round waits for its partner (the measured skews): the chain's
    # 3 hops still beat scan's 2 rounds at 4 ranks, its 7 hops lose to 3 rounds at 8
    for P in (2, 4):
        assert choice.pick(_nodes(P, 8), kind, *state)[0] == "forge"
    for P in (8, 64, 1024):
        best, times = choice.pick(_nodes(P, 8), kind, *state)
        assert best == "scan", times
        # the chain grows with P, the pick with log P
        assert times["forge"] > (1.0 if P == 8 else 1.4) * times["scan"]
    # across nodes scan's 10 rounds beat hier's 11 (3 in the node, 7 across, 1 back): a
    # further round costs more than what hier's NVLink rounds save
    times = choice.pick(_nodes(1024, 8), kind, *state)[1]
    assert times["scan"] < times["hier"]


def test_with_puts_alone_a_bigger_state_moves_the_crossover_and_hier_wins_across_nodes(
        monkeypatch):
    # the model without the measured skews: B=4 (four times the bytes per hop) takes the
    # log-depth rounds inside an 8-GPU node where B=1 keeps the chain; across nodes hier's
    # NVLink rounds beat scan's InfiniBand ones
    monkeypatch.setattr(choice, "HOP_SKEW_US", 0.0)
    monkeypatch.setattr(choice, "ROUND_SKEW_US", 0.0)
    assert choice.pick(_nodes(8, 8), Kind.SCALAR, *B4)[0] == "scan"
    assert choice.pick(_nodes(8, 8), Kind.SCALAR, *B1)[0] == "forge"
    assert choice.pick(_nodes(1024, 8), Kind.SCALAR, *B1)[0] == "hier"


def test_link_parameters_are_the_cost_models():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scaling_benchmarks.cost_model import DEFAULTS

    nv, ib, hw = DEFAULTS["nvlink"], DEFAULTS["ib"], DEFAULTS["hardware"]
    assert (choice.IN_NODE.latency_us, choice.IN_NODE.GBps) == \
        (nv["dev_latency_us"], nv["dev_GBps"])
    assert (choice.ACROSS_NODES.latency_us, choice.ACROSS_NODES.GBps) == \
        (ib["dev_latency_us"], ib["dev_GBps"])
    assert (choice.HBM_GBPS, choice.FP32_TFLOPS, choice.KERNEL_LAUNCH_US, choice.N_SMS) == \
        (hw["hbm_GBps"], hw["fp32_tflops"], hw["kernel_launch_us"], hw["n_sms"])
    assert choice.TILE_BYTES == DEFAULTS["forge"]["tile_kib"] * 1024
    assert (choice.HOP_SKEW_US, choice.ROUND_SKEW_US) == \
        (DEFAULTS["forge"]["hop_skew_us"], DEFAULTS["forge"]["round_skew_us"])


def _auto(group):
    import os

    import torch
    import torch.distributed as dist

    from forge_dist import sp
    from forge_dist.sp import base, layout

    os.environ["FORGE_DIST_NODE"] = str(dist.get_rank(group))  # one rank per node
    layout.forget()
    base._forge_for_auto = lambda device, group: True  # as for CUDA tensors of the whole job
    # the model with puts alone, where 4 nodes of one rank and one node of 4 differ
    choice.HOP_SKEW_US = choice.ROUND_SKEW_US = 0.0
    got = sp.resolve("auto", torch.device("cpu"), group, kind=Kind.SCALAR, state=B1).name
    return {"got": got, "nodes": layout.nodes(group)}


def test_auto_takes_the_models_pick_for_the_groups_layout(monkeypatch):
    out = run_world(4, _auto)
    monkeypatch.setattr(choice, "HOP_SKEW_US", 0.0)
    monkeypatch.setattr(choice, "ROUND_SKEW_US", 0.0)
    want, _ = choice.pick(out["nodes"], Kind.SCALAR, *B1)
    assert out["nodes"] == [[0], [1], [2], [3]] and want != "forge"
    assert choice.pick([[0, 1, 2, 3]], Kind.SCALAR, *B1)[0] == "forge"
    assert out["got"] == want

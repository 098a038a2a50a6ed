"""The scan laid out by node (``hier``).

Nodes are simulated on one machine: each rank sets ``FORGE_DIST_NODE`` before its first call
(what torchrun's ``GROUP_RANK`` or slurm's ``SLURM_NODEID`` give on a real job).  Checked:
the batched host rounds at 6 and 8 gloo ranks in even and uneven
layouts against the fp64 recurrence (every op, dense and packed, outputs and every gradient);
that only the nodes' last ranks exchange across nodes, ``ceil(log2 N)`` times each way; and
the GPU-initiated rounds over the simulated transport with concurrent jittered ranks.
"""
import math

import pytest
import torch

from forge_dist.selftest import OPS, run_case, tolerance
from forge_dist.sp import layout as sp_layout

from .distributed import run_world
from .test_scan import DEVICE_ENV, HOST, counting_transfers, small_simple_gla


def _place(group, layout):
    """Put this rank on its node of ``layout`` (node sizes in rank order)."""
    import os

    import torch.distributed as dist

    node_ids = [n for n, size in enumerate(layout) for _ in range(size)]
    os.environ["FORGE_DIST_NODE"] = str(node_ids[dist.get_rank(group)])
    sp_layout.forget()


def _errors(group, layout, ops, layouts, T_local):
    _place(group, layout)
    return {"nodes": sp_layout.nodes(group),
            "rows": [run_case(op, "hier", torch.float64, varlen, group=group,
                              T_local=T_local).as_dict()
                     for op in ops for varlen in layouts]}


def _check(out, layout, n_rows):
    assert [len(m) for m in out["nodes"]] == list(layout)
    assert len(out["rows"]) == n_rows
    for row in out["rows"]:
        bad = {k: v for k, v in row["errors"].items() if not v <= tolerance(torch.float64)}
        assert not bad, (row["op"], row["varlen"], bad)
        assert {"o", "final_state", "d_initial_state"} <= set(row["errors"])


@pytest.mark.parametrize("layout,ops", [
    ((2, 2, 2), OPS),
    ((1, 3, 2, 2), ("simple_gla", "gated_delta_rule")),
], ids=["3x2", "1-3-2-2"])
def test_hier_matches_the_recurrence(layout, ops):
    out = run_world(sum(layout), _errors, layout, ops, (False, True), 12, env=HOST)
    _check(out, layout, 2 * len(ops))


def _rounds(group, layout):
    """Per rank: host exchanges with a peer on another node, forward and backward."""
    import torch.distributed as dist

    from forge_dist.sp import p2p

    _place(group, layout)
    node_of = {r: n for n, m in enumerate(sp_layout.nodes(group)) for r in m}
    rank = dist.get_rank(group)
    across = []
    real_exchange = p2p.exchange

    def exchange(send, dst, recv_buf, src, *args, **kwargs):
        across.append(sum(1 for peer in (dst, src) if peer >= 0 and node_of[peer] != node_of[rank]))
        return real_exchange(send, dst, recv_buf, src, *args, **kwargs)
    p2p.exchange = exchange
    try:
        o = small_simple_gla(group, "hier")
        fwd = sum(1 for n in across if n)
        o.sum().backward()
    finally:
        p2p.exchange = real_exchange
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (fwd, sum(1 for n in across if n) - fwd), group=group)
    return out


def test_only_the_nodes_last_ranks_cross_nodes_in_log2_N_rounds():
    layout = (2, 2, 2, 2)
    per_rank = run_world(8, _rounds, layout, env=HOST)
    rounds = math.ceil(math.log2(len(layout)))
    for rank, (fwd, bwd) in enumerate(per_rank):
        # forward: the last rank of each node; backward (reversed): the first
        assert fwd == (rounds if rank % 2 == 1 else 0), (rank, fwd)
        assert bwd == (rounds if rank % 2 == 0 else 0), (rank, bwd)


def _device_errors(group, layout):
    out, launches, exchanges = counting_transfers(
        lambda: _errors(group, layout, OPS, (False, True), 12))
    return dict(out, send_first_launches=launches, host_exchanges=exchanges)


def test_gpu_initiated_rounds_over_the_simulated_transport():
    layout = (2, 3)
    out = run_world(sum(layout), _device_errors, layout, env=DEVICE_ENV)
    assert out["send_first_launches"] > 0 and out["host_exchanges"] == 0, out
    _check(out, layout, 2 * len(OPS))


def test_two_node_launch_on_one_machine(tmp_path):
    """``launch/torchrun.sh --nnodes 2`` run twice here (a local c10d rendezvous, gloo): the
    ranks read two nodes of two from torchrun's environment (``GROUP_RANK``), and ``hier``
    matches the recurrence over them."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from forge_dist.selftest import free_port
    from tests.torchrun_workers import ROOT, launch_env

    env = dict(launch_env(), PYTHON=sys.executable, FORGE_DIST_TIMEOUT="120")
    env.pop("FORGE_DIST_NODE", None)
    env.pop("FORGE_DIST_RANKS_PER_NODE", None)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        ["bash", str(ROOT / "launch" / "torchrun.sh"), "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-node-test",
         str(ROOT / "tests" / "sp" / "two_node_worker.py"), str(tmp_path)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for n in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:  # torchrun and its workers, whatever state they are in
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    for r in range(4):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep["env"]["LOCAL_WORLD_SIZE"] == "2" and rep["env"]["WORLD_SIZE"] == "4"
        assert rep["nodes"] == [[0, 1], [2, 3]], rep
        assert len(rep["cases"]) == 4 and all(c["ok"] for c in rep["cases"]), rep["cases"]

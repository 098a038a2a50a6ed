"""A rank whose own arguments are bad makes every rank fail at once, not after a timeout."""
import time

import torch

from ..sp.distributed import run_world


def _one_rank_bad(group):
    import torch.distributed as dist

    from forge_dist import ops

    rank = dist.get_rank(group)
    q = torch.randn(1, 8, 2, 4)
    k = q[..., :3].clone() if rank == 1 else q.clone()  # rank 1: wrong K
    t0 = time.perf_counter()
    try:
        ops.linear_attn(q, k, torch.randn(1, 8, 2, 4), group=group)
        error = None
    except (ValueError, TypeError) as err:
        error = str(err)
    took = time.perf_counter() - t0
    dist.barrier(group=group)  # nobody is stuck
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, {"rank": rank, "error": error, "s": took}, group=group)
    return everyone


def test_peers_fail_fast_when_one_rank_rejects_its_arguments():
    rows = run_world(3, _one_rank_bad, env={"FORGE_DIST_TIMEOUT": "30"})
    assert rows[1]["error"].startswith("k:")
    for r in (0, 2):
        assert "rank 1 rejected its own arguments" in rows[r]["error"], rows[r]
    assert max(r["s"] for r in rows) < 10, rows  # far below the 30 s bound

"""A rank whose backward raised in the user's own code (a gradient hook), while its peers sit
in the backward's collective, and the README's rule after an error: every rank makes a new
process group and calls again on it.  The peers learn of the failure from a
``StatePassTimeout`` naming the rank within ``FORGE_DIST_TIMEOUT``; the calls on the new
group are right on every rank.  (Calling again on the old group instead, after
``sp.reset``, paired the failed rank's next collective with its peers' unfinished one, and
gloo aborted that process.)"""
import pytest
import torch

from tests.sp.distributed import run_world

T = 32  # tokens per rank


def _hook_fails_on_rank_1(world, strategy):
    import torch.distributed as dist

    from forge_dist import ops

    rank = dist.get_rank()
    ranks = list(range(dist.get_world_size()))
    group = dist.new_group(ranks)  # WORLD stays in step for the harness's last barrier
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, len(ranks) * T, 2, 16, generator=gen, dtype=torch.float64)
               for _ in range(3))
    g = torch.nn.functional.logsigmoid(
        torch.randn(1, len(ranks) * T, 2, generator=gen, dtype=torch.float64) + 3)
    mine = slice(rank * T, (rank + 1) * T)

    def call(grp, hook=False):
        q_r = q[:, mine].clone().requires_grad_()
        o, _ = ops.simple_gla(q_r, k[:, mine], v[:, mine], g[:, mine], group=grp,
                              strategy=strategy)
        if hook:
            def fail(grad):
                raise RuntimeError("the user's hook failed")
            o.register_hook(fail)
        o.sum().backward()
        return o.detach(), q_r.grad

    call(group)
    try:
        call(group, hook=rank == 1)
        second = "no error"
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        second = f"{type(err).__name__}: {err}"
    group = dist.new_group(ranks)  # the rule, on every rank
    o, dq = call(group)
    q_all = q.clone().requires_grad_()
    o_all, _ = ops.simple_gla(q_all, k, v, g)
    o_all.sum().backward()
    err = max((o - o_all.detach()[:, mine]).abs().max().item(),
              (dq - q_all.grad[:, mine]).abs().max().item())
    rows = [None] * len(ranks)
    dist.all_gather_object(rows, (second, err), group=group)
    return rows


@pytest.mark.parametrize("strategy", ["lasp2", "serial", "pipelined"])
def test_every_rank_recovers_on_a_new_group_after_one_ranks_hook_raised(strategy):
    rows = run_world(3, _hook_fails_on_rank_1, strategy, env={"FORGE_DIST_TIMEOUT": "5"})
    assert rows[1][0] == "RuntimeError: the user's hook failed", rows
    for r in (0, 2):  # both peers wait on rank 1 (for its gradient, or for it to take theirs)
        assert rows[r][0].startswith(f"StatePassTimeout: rank {r} gave up after 5s"), rows
        assert "from rank 1" in rows[r][0], rows
    for second, err in rows:
        assert err < 1e-10, rows

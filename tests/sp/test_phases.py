"""forge_dist.sp.phases: the named phase edges of an op call (what weak_scaling.py times)."""
import torch

from forge_dist.sp import phases

from .distributed import run_world


def _edges_of_a_training_call(group, strategy):
    import torch.distributed as dist

    from forge_dist import ops

    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=gen).requires_grad_() for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 32, 2, generator=gen)).requires_grad_()
    seen = []
    with phases.listen(lambda name, begin: seen.append([name, begin])):
        o, _ = ops.simple_gla(q, k, v, g, group=group, strategy=strategy)
        o.sum().backward()
    n = len(seen)
    ops.simple_gla(q, k, v, g, group=group, strategy=strategy)  # nothing listens any more
    return {"seen": seen, "late": len(seen) - n, "listening": phases.listening()}


def test_two_ranks_pass_every_phase_edge_in_order():
    res = run_world(2, _edges_of_a_training_call, "serial")
    assert res["seen"] == [["check", True], ["check", False],
                           ["state_pass", True], ["state_pass", False],
                           ["merge", True], ["merge", False],
                           ["backward_chain", True], ["backward_chain", False]]
    assert res["listening"] is False and res["late"] == 0


def test_one_device_call_has_only_the_merge_phase_and_hooks_nest():
    from forge_dist import ops

    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 16, 2))
    outer, inner = [], []
    assert not phases.listening()
    with phases.listen(lambda n, b: outer.append((n, b))):
        with phases.listen(lambda n, b: inner.append((n, b))):
            ops.simple_gla(q, k, v, g)
        ops.simple_gla(q, k, v, g)
    assert not phases.listening()
    assert inner == [("merge", True), ("merge", False)]
    assert outer == inner * 2


def test_profiler_ranges_name_the_phases():
    from forge_dist import ops

    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 16, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phases.profiler_ranges():
            ops.simple_gla(q, k, v, g)
    assert "forge_dist::merge" in {e.key for e in prof.key_averages()}

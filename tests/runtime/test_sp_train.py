"""Sequence-parallel training through plans (forge_dist/runtime/sp_train.py): the ops'
calls with gradients and a group, on concurrent gloo ranks under Triton's interpreter,
against the fp64 recurrence in one process: outputs, final states and every gradient."""
from __future__ import annotations

import pytest
import torch

from forge_dist import kernels

pytestmark = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="needs triton")

B, H, K, V = 1, 2, 16, 16
TL = 80  # tokens per rank: a full and a partial 64-token chunk


def _inputs(op, T, seed, gated=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if op == "hgrn":  # x, g [B, T, D] with D = K
        return {"x": r(B, T, K),
                "g": -torch.rand(B, T, K, generator=g, dtype=torch.float64) * 0.2}
    d = {"q": r(B, T, H, K), "k": r(B, T, H, K) * 0.5, "v": r(B, T, H, V)}
    if op == "gated_delta_rule":
        d["k"] = torch.nn.functional.normalize(d["k"], dim=-1)
        # weak decays and small betas: a shard's transition M stays far from zero, so that
        # a wrong one (another call's) shows in rank 0's gradients
        d["g"] = (-torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.02
                  if gated else None)  # (positional: beta follows g)
        d["beta"] = torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.3
    if op == "simple_gla" and gated:
        d["g"] = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2
    if op == "gla":
        d["g"] = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64) * 0.2
    return d


def _two_layers(op, gated, strategy, group, rank, P, mine) -> float:
    """The largest relative difference between the gradients of two calls whose backwards
    ran after both forwards and those of the same calls each followed by its backward."""
    from forge_dist import ops

    def call(seed):
        x = {n: None if t is None else t[:, mine].float().contiguous().requires_grad_(True)
             for n, t in _inputs(op, P * TL, seed=seed, gated=gated).items()}
        o, _ = getattr(ops, op)(*x.values(), group=group, strategy=strategy)
        return x, (o * (1 + seed)).sum()
    alone = []
    for seed in (5, 6):
        x, loss = call(seed)
        loss.backward()
        alone.append(x)
    (xa, la), (xb, lb) = call(5), call(6)
    lb.backward()
    la.backward()
    return max(float((x[n].grad - y[n].grad).norm() / y[n].grad.norm())
               for x, y in zip((xa, xb), alone) for n in x if x[n] is not None)


def _train_world(group, cases):
    """Every rank runs three training calls per case (one with an initial state and every
    rank's final state in the loss, then twice the usual call, the second on its cached
    plan) and returns, per case, the largest relative error of o, the final state and each
    gradient against one process in fp64, and whether the calls ran on a training plan."""
    import torch.distributed as dist

    from forge_dist import sp
    from forge_dist.kernels import walker
    from tests.sp.training_check import draws, errors, reference, train_rank

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    mine = slice(rank * TL, (rank + 1) * TL)
    report = {}
    longest_raw = walker.SUM_GATES_IN_WALK_MAX_TOKENS
    for op, strategy, gated in cases:
        worst, planned = 0.0, True
        # the delta rule under lasp2: its backward sums the gates in a launch of their own,
        # as past that many tokens, so that the cut of its backward places that launch too
        walker.SUM_GATES_IN_WALK_MAX_TOKENS = (
            0 if (op, strategy) == ("gated_delta_rule", "lasp2") else longest_raw)
        for step in range(3):
            full = _inputs(op, P * TL, seed=step, gated=gated)
            h0, do, dht = draws(step, B, P * TL, H, K, V, vector_state=op == "hgrn")
            if step > 0:  # the usual training call: no initial or final state
                h0 = dht = None
            ref = reference(op, full, h0, do, dht, P, TL)
            # this rank's shard, fp32, through the kernels and the group
            x = {n: None if t is None else t[:, mine].float().contiguous().requires_grad_(True)
                 for n, t in full.items()}
            s0 = h0.float().requires_grad_(True) if rank == 0 and h0 is not None else None
            # serial's calls: a second backward through the kept graph (retain_graph)
            o_r, ht_r = train_rank(op, x, s0, do[:, mine], dht, group, strategy,
                                   twice=strategy == "serial")
            planned &= type(o_r.grad_fn).__name__ == "_PlannedSequenceParallelBackward"
            worst = max(worst, *errors(ref, rank, P, TL, o_r, ht_r, x, s0))
            if step == 2 and (strategy == "scan" or op == "gated_delta_rule"):
                # two calls on one plan before either backward (two layers of one shape):
                # the first backward must see its own incoming state, not the second's
                worst = max(worst, _two_layers(op, gated, strategy, group, rank, P, mine))
        report[f"{op}{'' if gated else '-ungated'}/{strategy}"] = [worst, planned]
    sp.flush()
    everyone = [None] * P
    dist.all_gather_object(everyone, report, group=group)
    return everyone


def test_training_plans_of_every_strategy_match_fp64_over_gloo():
    """3 concurrent ranks (forge through the simulated transport with random delays):
    every chain strategy for linear_attn, simple_gla with and without its gate and gla,
    hgrn under forge and scan (its own backward is the same under every chain; the
    baselines' chains are the matrix ops' above) (scan: the gated ops); the delta rule
    with and without its gate under forge, gated under serial, lasp2 (its gate sums in a
    launch of their own), pipelined and scan (two layers on one plan: its kept transition);
    the gradients
    of the initial state (rank 0) and of every rank's returned final state flow through the
    reverse chain; serial's calls run their backward twice (``retain_graph``)."""
    from tests.sp.distributed import run_world

    cases = [(op, s, gated) for op, gated in (("linear_attn", True), ("simple_gla", True),
                                              ("simple_gla", False), ("gla", True))
             for s in ("forge", "serial", "lasp2", "pipelined")]
    # scan keeps its rounds' buffers in the plan, forward and backward (sp/scan.py)
    cases += [("simple_gla", "scan", True), ("gla", "scan", True)]
    # hgrn (a vector state: the scan of its backward's segments, sp_train._backward_vector)
    cases += [("hgrn", s, True) for s in ("forge", "scan")]
    # the delta rule (a dense transition: every part of its backward's cut, three roles)
    cases += [("gated_delta_rule", "forge", gated) for gated in (True, False)]
    cases += [("gated_delta_rule", s, True) for s in ("serial", "lasp2", "pipelined", "scan")]
    everyone = run_world(3, _train_world, cases,
                         env={"TRITON_INTERPRET": "1", "FORGE_DIST_KERNELS": "triton",
                              "FORGE_DIST_SIM_JITTER_MS": "3", "FORGE_DIST_TIMEOUT": "120"})
    for rank, report in enumerate(everyone):
        assert len(report) == len(cases)
        not_planned = [k for k, (_, planned) in report.items() if not planned]
        assert not not_planned, f"rank {rank}: the general path ran {not_planned}"
        bad = {k: err for k, (err, _) in report.items() if not err < 1e-4}
        assert not bad, f"rank {rank}: {bad}"

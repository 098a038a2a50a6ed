"""forge at op level on the CPU: 3 and 4 gloo ranks running concurrently.

The forge kernel runs under Triton's interpreter over the simulated transport in shared
memory (:func:`forge_dist.comm.channel.make_shared_sim_channel`): every rank is its own
process, the ranks run at the same time as they do on GPUs, and a random delay before every
launch (``FORGE_DIST_SIM_JITTER_MS``) makes them interleave in many orders.  A put is
delivered only at its ``quiet_put`` and reads the staging tile as it is then, so a missing
quiet, a missing credit wait or a reused staging tile fails here.

Checked against the fp64 recurrence on one process: every op, dense and packed sequences
(sequences straddling ranks), the output and every gradient.
"""
import pytest
import torch

from .distributed import run_world

OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]
T_LOCAL, H, D = 16, 2, 16
ENV = {"TRITON_INTERPRET": "1", "FORGE_DIST_SIM_JITTER_MS": "5", "FORGE_DIST_TIMEOUT": "120"}


def _inputs(op, T, seed):
    gen = torch.Generator().manual_seed(seed)
    F = torch.nn.functional

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    if op == "hgrn":
        return {"x": r(1, T, H * D), "g": F.logsigmoid(r(1, T, H * D) + 2)}
    inp = {"q": r(1, T, H, D), "k": r(1, T, H, D), "v": r(1, T, H, D)}
    if op == "simple_gla":
        inp["g"] = F.logsigmoid(r(1, T, H) + 3)
    elif op == "gla":
        inp["g"] = F.logsigmoid(r(1, T, H, D) + 3)
    elif op == "gated_delta_rule":
        inp["k"] = F.normalize(inp["k"], dim=-1)
        inp["g"] = F.logsigmoid(r(1, T, H) + 3)
        inp["beta"] = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    return inp


def _call(op, inp, **kw):
    from forge_dist import ops

    if op == "hgrn":
        return ops.hgrn(inp["x"], inp["g"], **kw)[0]
    args = [inp["q"], inp["k"], inp["v"]]
    if op == "gated_delta_rule":
        args += [inp["g"], inp["beta"]]
    elif op != "linear_attn":
        args.append(inp["g"])
    return getattr(ops, op)(*args, **kw)[0]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _ops_world(group):
    import torch.distributed as dist

    from forge_dist import sp

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    T = T_LOCAL * P
    mine = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    errors = {}
    for op in OPS:
        for packed in (False, True):
            # packed: sequences that start and end inside shards and straddle each boundary
            cu = torch.tensor([0, 5] + [r * T_LOCAL + 3 for r in range(1, P)] + [T]
                              if packed else [0, T], dtype=torch.int64)
            cu_arg = cu if packed else None
            full = _inputs(op, T, seed=len(op) + 7 * packed)
            weight = torch.randn(_call(op, full, cu_seqlens=cu_arg).shape,
                                 generator=torch.Generator().manual_seed(3), dtype=torch.float64)
            ref_in = {k: v.clone().requires_grad_(True) for k, v in full.items()}
            (_call(op, ref_in, cu_seqlens=cu_arg) * weight).sum().backward()
            ref_o = _call(op, full, cu_seqlens=cu_arg)
            shard = {k: v[:, mine].clone().requires_grad_(True) for k, v in full.items()}
            o = _call(op, shard, cu_seqlens=cu_arg, group=group, strategy="forge")
            (o * weight[:, mine]).sum().backward()
            errs = [_rel(o.detach(), ref_o[:, mine])]
            errs += [_rel(shard[k].grad, ref_in[k].grad[:, mine]) for k in full]
            errors[f"{op}{'/packed' if packed else ''}"] = max(errs)
    sp.flush()
    everyone = [None] * P
    dist.all_gather_object(everyone, errors, group=group)
    dist.barrier(group=group)
    return everyone


@pytest.mark.parametrize("P", [3, 4])
def test_forge_ops_forward_and_every_gradient_match_fp64(P):
    everyone = run_world(P, _ops_world, env=ENV)
    for rank, errors in enumerate(everyone):
        assert set(errors) == {f"{op}{s}" for op in OPS for s in ("", "/packed")}
        bad = {k: v for k, v in errors.items() if not v < 1e-10}
        assert not bad, f"rank {rank}: {bad}"


def _back_to_back(group, n_calls):
    import os

    import torch.distributed as dist

    from forge_dist import sp

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if rank == P - 1:  # a slow consumer: the producers may run ahead only by the credits
        os.environ["FORGE_DIST_SIM_JITTER_MS"] = "60"
    T = T_LOCAL * P
    mine = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    outs, refs = [], []
    for i in range(n_calls):  # forward only: nothing makes rank 0 wait for its consumers
        full = _inputs("simple_gla", T, seed=100 + i)
        refs.append(_call("simple_gla", full)[:, mine])
        with torch.no_grad():
            outs.append(_call("simple_gla", {k: v[:, mine].contiguous() for k, v in
                                             full.items()}, group=group, strategy="forge"))
    sp.flush()
    errs = [_rel(o, r) for o, r in zip(outs, refs)]
    everyone = [None] * P
    dist.all_gather_object(everyone, errs, group=group)
    dist.barrier(group=group)
    return everyone


def test_forge_back_to_back_calls_with_a_slow_consumer():
    everyone = run_world(3, _back_to_back, 6, env=dict(ENV, FORGE_DIST_SIM_JITTER_MS="0"))
    for rank, errs in enumerate(everyone):
        assert len(errs) == 6 and all(e < 1e-10 for e in errs), (rank, errs)

"""A rank's sequence-parallel call as one autograd node (forge_dist/ops/shard_call.py): the
calls with gradients that have no training plan (fp16 inputs, non-contiguous tensors,
hgrn's and the delta rule's among them), on concurrent gloo ranks under Triton's
interpreter, against the fp64 recurrence in one process: output, final state and every
gradient."""
from __future__ import annotations

import pytest
import torch

from forge_dist import kernels

pytestmark = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="needs triton")

B, H, K, V = 1, 2, 16, 16
TL = 80  # tokens per rank: a full and a partial 64-token chunk


def _inputs(op, T, seed, gated):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if op == "hgrn":  # x, g [B, T, D] with D = K
        return {"x": r(B, T, K), "g": -torch.rand(B, T, K, generator=g, dtype=torch.float64)}
    d = {"q": r(B, T, H, K), "k": r(B, T, H, K) * 0.5, "v": r(B, T, H, V)}
    if op == "gated_delta_rule":
        d["k"] = torch.nn.functional.normalize(d["k"], dim=-1)
        d["g"] = (-torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2
                  if gated else None)
        d["beta"] = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    elif gated:
        d["g"] = -torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.2
    return d


def _on_shard_call(t) -> bool:
    """Whether ``t`` came out of the shard's one autograd node (maybe through a cast)."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None:
            return False
        if type(fn).__name__ == "_ShardCallBackward":
            return True
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


def _world(group, cases):
    import torch.distributed as dist

    from forge_dist import sp
    from tests.sp.training_check import draws, errors, reference, train_rank

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    mine = slice(rank * TL, (rank + 1) * TL)
    report = {}
    for op, strategy, gated, form in cases:
        worst, taken = 0.0, True
        for step in range(2):  # with an initial and a final state, then without
            full = _inputs(op, P * TL, step, gated)
            h0, do, dht = draws(step, B, P * TL, H, K, V, vector_state=op == "hgrn")
            if step > 0:  # the usual training call: no initial or final state
                h0 = dht = None
            ref = reference(op, full, h0, do, dht, P, TL)
            dtype = torch.float16 if form == "fp16" else torch.float32
            x = {}
            for n, t in full.items():
                if t is None:
                    x[n] = None
                    continue
                shard = t[:, mine].to(torch.float32 if n in ("g", "beta") and op != "hgrn"
                                      else dtype)
                if form == "strided" and n in ("q", "v", "x"):  # a view of a wider tensor
                    wide = torch.zeros(*shard.shape[:-1], 2 * shard.shape[-1], dtype=dtype)
                    wide[..., ::2] = shard
                    shard = wide[..., ::2]
                x[n] = shard.detach().requires_grad_(True)
            s0 = h0.float().requires_grad_(True) if rank == 0 and h0 is not None else None
            # serial's calls: a second backward through the kept graph (retain_graph)
            o_r, ht_r = train_rank(op, x, s0, do[:, mine], dht, group, strategy,
                                   twice=strategy == "serial")
            taken &= _on_shard_call(o_r)
            worst = max(worst, *errors(ref, rank, P, TL, o_r, ht_r, x, s0))
        report[f"{op}/{strategy}/{'gated' if gated else 'ungated'}/{form}"] = [worst, taken]
    sp.flush()
    everyone = [None] * P
    dist.all_gather_object(everyone, report, group=group)
    return everyone


def test_shard_calls_match_fp64_over_gloo():
    """3 concurrent ranks (forge through the simulated transport with random delays): the
    delta rule with and without its gate under forge, serial, lasp2 and pipelined, the decay ops' calls that
    take no plan (fp16, a strided q and v, hgrn's strided x); serial's calls run their backward
    twice (``retain_graph``)."""
    from tests.sp.distributed import run_world

    # the delta rule (its fp32 calls take training plans, tests/runtime/test_sp_train.py)
    # strided with and without g under forge; one form under each other strategy
    cases = ([("gated_delta_rule", "forge", gated, "strided") for gated in (True, False)]
             + [("gated_delta_rule", "serial", True, "fp16"),
                ("gated_delta_rule", "lasp2", False, "strided"),
                ("gated_delta_rule", "pipelined", True, "strided"),
                ("simple_gla", "forge", True, "fp16"), ("simple_gla", "lasp2", True, "strided"),
                ("linear_attn", "serial", False, "strided")]
             + [("hgrn", s, True, "strided") for s in ("forge", "serial")])
    everyone = run_world(3, _world, cases,
                         env={"TRITON_INTERPRET": "1", "FORGE_DIST_KERNELS": "triton",
                              "FORGE_DIST_SIM_JITTER_MS": "3", "FORGE_DIST_TIMEOUT": "120"})
    for rank, report in enumerate(everyone):
        assert len(report) == len(cases)
        missed = [k for k, (_, taken) in report.items() if not taken]
        assert not missed, f"rank {rank}: the runner's general form ran {missed}"
        # fp16 inputs: the outputs are fp16 (the kernels run in fp32)
        bad = {k: err for k, (err, _) in report.items()
               if not err < (2e-3 if k.endswith("fp16") else 1e-4)}
        assert not bad, f"rank {rank}: {bad}"

"""Rank function for test_determinism.py: bit-level fingerprints of outputs and gradients."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from forge_dist import selftest

OPS = selftest.OPS
STRATEGIES = ("serial", "pipelined", "lasp2")


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(op, strategy, dtype, varlen, group, seed=0, T_local=24, dims=(6, 5, 12)):
    """sha256 of (o, final_state, every input gradient) gathered over ranks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    T = T_local * world
    full, cu = selftest._problem(op, T, T_local, dtype, "cpu", seed, varlen, dims)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    mine = {k: (v[:, sl] if k != "initial_state" else v).clone().requires_grad_()
            for k, v in full.items()}
    o, final = selftest.call_op(op, mine, output_final_state=True, cu_seqlens=cu, group=group,
                                 strategy=strategy)
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    (o * w).sum().add(final.square().sum()).backward()
    mine_fp = _digest([o, final] + [mine[k].grad if mine[k].grad is not None
                                    else torch.zeros(()) for k in sorted(mine)])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine_fp, group=group)
    return "/".join(everyone)


def fingerprints(me, repeats=2, dtypes=("float32", "float64"), wide=True):
    """{op|dtype|layout|dims: {strategy: [fingerprint per repeat]}} on this world.

    ``wide`` adds head sizes 64 x 64 (HGRN: D = 64), where BLAS blocking and the pipelined
    strategy's column tiles could change summation order if anything did."""
    out = {}
    shapes = [(6, 5, 12)] + ([(64, 64, 64)] if wide else [])
    for op in OPS:
        for dtype in dtypes:
            for varlen in (False, True):
                for dims in shapes:
                    key = f"{op}|{dtype}|{'packed' if varlen else 'dense'}|{dims[0]}"
                    out[key] = {s: [fingerprint(op, s, getattr(torch, dtype), varlen, me.group,
                                                dims=dims) for _ in range(repeats)]
                                for s in STRATEGIES}
    return out

"""Determinism on the CPU (gloo): bitwise-identical outputs, final states and gradients
(a) for repeated calls in one process group, (b) across fresh process groups, and (c)
across the serial, pipelined and lasp2 strategies, which on the CPU apply the same combines
in the same order (the pipelined strategy's column tiles do not change any summation: M
acts along K).  The forge strategy over the simulated transport is checked against a plain
PyTorch fold of the same combines (bitwise for the elementwise kinds; the dense kind's
tl.dot runs through NumPy in the interpreter and is only close).  Not promised: identical
bits across world sizes (shard boundaries change the chunking) or between CPU and GPU."""
import functools
import os

import pytest
import torch

from . import determinism_worker as dw
from ._world import spawn


@functools.lru_cache(maxsize=None)
def prints(world, run, dtypes=("float32",), wide=True):
    return spawn(world, dw.fingerprints, 2, dtypes, wide, deadline_s=300)[0]


def _check(a, b=None):
    for key, per in a.items():
        for strategy, fps in per.items():
            assert len(set(fps)) == 1, f"{key} {strategy}: repeated calls differ: {fps}"
        assert len({fps[0] for fps in per.values()}) == 1, f"{key}: strategies differ: {per}"
        if b is not None:
            assert b[key] == per, f"{key}: a fresh process group gave other bits"


def test_bitwise_across_calls_groups_and_strategies_world2():
    _check(prints(2, 0), prints(2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bitwise_full_matrix(world):
    _check(prints(world, 0, ("float32", "float64")), prints(world, 1, ("float32", "float64")))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
@pytest.mark.parametrize("kind", ["identity", "scalar", "diagonal", "dense"])
def test_forge_sim_against_the_fold(kind):
    from forge_dist.comm.sim import SimWorld
    from forge_dist.sp import forge
    from forge_dist.variants import transitions as tr
    from forge_dist.variants.transitions import Kind

    kind = Kind(kind)
    P, B, H, K, V = 3, 1, 2, 32, 48
    gen = torch.Generator().manual_seed(5)
    M = {Kind.IDENTITY: lambda: None, Kind.SCALAR: lambda: torch.rand(B, H, generator=gen),
         Kind.DIAGONAL: lambda: torch.rand(B, H, K, generator=gen),
         Kind.DENSE: lambda: torch.randn(B, H, K, K, generator=gen) / K}[kind]
    Ms = [M() for _ in range(P)]
    ds = [torch.randn(B, H, K, V, generator=gen) for _ in range(P)]
    S0 = torch.randn(B, H, K, V, generator=gen)
    runs = []
    for _ in range(2):
        world = SimWorld(P)
        runs.append([forge.FORGE.forward_chain(kind, Ms[r] if r < P - 1 else None, ds[r],
                                               S0 if r == 0 else torch.zeros_like(S0),
                                               world[r])[0] for r in range(P)])
    S, want = S0, []
    for r in range(P):
        want.append(S)
        S = tr.combine(kind, Ms[r], S, ds[r])
    for a, b, w in zip(runs[0], runs[1], want):
        assert torch.equal(a, b)  # run to run: bitwise
        if kind is Kind.DENSE:
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, w)

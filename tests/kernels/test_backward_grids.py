"""Every backward launch keeps the sequence on grid axis 0.

CUDA caps grid axes 1 and 2 at 65535 blocks, so a launch with one program per chunk on those
axes fails on a GPU past 65535 chunks (4M tokens at 64-token chunks) while the interpreter,
which has no such cap, runs it.  Here each kernel is wrapped to record its grids at two
sequence lengths: axes 1 and 2 must not change with T.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels import (delta, delta_backward, scalar_backward, vector_backward,
                                vector_state, walker)

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Recorder:
    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


MODULES = (walker, delta, delta_backward, scalar_backward, vector_backward, vector_state)


def _record(monkeypatch, log):
    for mod in MODULES:
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                monkeypatch.setattr(mod, name, _Recorder(f"{mod.__name__}.{name}", obj, log))


def _matrix(T, gate_dims):
    gen = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    q, k, v = r(1, T, 2, 16), torch.nn.functional.normalize(r(1, T, 2, 16), dim=-1), r(1, T, 2, 16)
    g = torch.nn.functional.logsigmoid(r(1, T, 2, *gate_dims) + 2)
    return q, k, v, g, r(1, 2, 16, 16), r(1, T, 2, 16), r(1, 2, 16, 16)


def _calls(T):
    q, k, v, g, S, do, dht = _matrix(T, ())
    scalar_backward.scalar_decay_backward(q, k, v, g, S, do, dht, 0.25,
                                          tiles={"dqk_BK": 8, "walk_BK": 8})  # 2 K tiles
    delta_backward.delta_rule_backward(q, k, v, g, torch.sigmoid(g), S, do, dht, 0.25,
                                       tiles={"dqk_BK": 8})
    q, k, v, g, S, do, dht = _matrix(T, (16,))
    vector_backward.vector_decay_backward(q, k, v, g, S, do, dht, 0.25, tiles={"dqk_BK": 8})
    x = torch.randn(1, T, 24, device=DEV)
    vector_state.hgrn_backward(x, torch.nn.functional.logsigmoid(x), x[:, 0], x, x[:, 0],
                               BD=8, n_seg=2)


def test_the_sequence_stays_on_grid_axis_0(monkeypatch):
    short, long = [], []
    _record(monkeypatch, short)
    _calls(64)
    monkeypatch.undo()
    _record(monkeypatch, long)
    _calls(200)
    assert [n for n, _ in short] == [n for n, _ in long] and len(short) >= 12, (short, long)
    for (name, a), (_, b) in zip(short, long):
        assert a[1:] == b[1:], f"{name}: grid axes 1, 2 grow with T: {a} -> {b}"
    grew = {name for (name, a), (_, b) in zip(short, long) if a[0] != b[0]}
    assert any("_dqk_kernel" in n for n in grew)
    # hgrn walks a fixed number of segments, one token per step: no launch grows with T
    assert not any("vector_state" in n for n in grew), grew

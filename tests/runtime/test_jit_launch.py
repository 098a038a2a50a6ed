"""forge_dist.runtime.jit_launch: relaunching a kernel the JIT compiled (CPU, with a fake
compiled kernel; the GPU test in test_gpu.py runs real ones)."""
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.runtime import jit_launch  # noqa: E402


def _kernel_fn(x, y, n, scale, BLOCK, FLAG, extra=None, MODE=3):
    """Stands for a ``@triton.jit`` function: its parameters are what counts."""


class _Param:
    def __init__(self, p):
        self.name = p.name
        self.default = p.default
        self.has_default = p.default is not inspect.Parameter.empty


FN = SimpleNamespace(params=[_Param(p) for p in
                             inspect.signature(_kernel_fn).parameters.values()])


class _Compiled:
    """What ``fn[grid](...)`` returns on a GPU: a launcher, a function, packed metadata."""

    def __init__(self):
        self.calls = []
        self.function = 1234
        self.packed_metadata = (4, 1, 0)

    def run(self, *args):
        self.calls.append(args)


ARGS = (("x", "buf", "a"), ("y", "buf", "b"), ("n", "i32", 96), ("scale", "fp32", 0.5))
CONST = {"BLOCK": 64, "FLAG": True, "extra": None}


def _tensors(offset_bytes=0):
    a = torch.zeros(64, dtype=torch.float32)
    b = torch.zeros(64 + 4, dtype=torch.float32)[offset_bytes // 4:][:64]
    return {"a": a, "b": b}


def test_launch_passes_every_parameter_in_order():
    k = _Compiled()
    t = _tensors()
    launch = jit_launch.CompiledLaunch.make(k, FN, (3, 2, 1), ARGS, CONST, t)
    assert launch is not None and launch.buffers == ("a", "b")
    t2 = {"a": torch.ones(64), "b": torch.ones(64)}
    launch(t2, stream=77)
    (call,) = k.calls
    assert call[:9] == (3, 2, 1, 77, 1234, (4, 1, 0), None, None, None)
    x, y, n, scale, block, flag, extra, mode = call[9:]
    assert x is t2["a"] and y is t2["b"]  # this call's tensors, not the first call's
    assert (n, scale, block, flag, extra, mode) == (96, 0.5, 64, True, None, 3)  # MODE: default


def test_unaligned_tensors_are_refused():
    k = _Compiled()
    assert jit_launch.CompiledLaunch.make(k, FN, (1, 1, 1), ARGS, CONST, _tensors(4)) is None
    launch = jit_launch.CompiledLaunch.make(k, FN, (1, 1, 1), ARGS, CONST, _tensors())
    assert launch.aligned(_tensors()) and not launch.aligned(_tensors(4))


def test_interpreter_results_and_unnamed_parameters_are_refused():
    t = _tensors()
    assert jit_launch.CompiledLaunch.make(None, FN, (1, 1, 1), ARGS, CONST, t) is None
    missing = {"BLOCK": 64}  # FLAG has no default and is not given
    assert jit_launch.CompiledLaunch.make(_Compiled(), FN, (1, 1, 1), ARGS, missing, t) is None


def test_a_launch_hook_turns_the_fast_path_off(monkeypatch):
    from triton import knobs

    assert jit_launch.usable()
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not jit_launch.usable()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert jit_launch.usable()


def test_the_switch_turns_it_off_and_is_checked(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "0")
    assert not jit_launch.usable()
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "yes")
    with pytest.raises(ValueError, match="FORGE_DIST_JIT_RELAUNCH"):
        jit_launch.usable()

"""forge_dist.kernels.jit_launch: relaunching a kernel the JIT compiled (CPU, with a fake
compiled kernel; the GPU test in test_gpu.py runs real ones)."""
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels import jit_launch  # noqa: E402


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


class _FakeJIT:
    """Stands for a ``JITFunction``: ``fn[grid](*args, **kwargs)`` records the JIT's calls
    and returns one compiled kernel."""

    def __init__(self):
        self.params = FN.params
        self.jit_calls = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


def _kept(monkeypatch):
    monkeypatch.setattr(jit_launch, "raw_stream", lambda index: 55)
    fn = _FakeJIT()
    return fn, jit_launch.KeptLaunches(fn, devices=("cpu",))  # compiled kernels faked on the CPU


def test_kept_launches_relaunch_the_first_calls_kernel(monkeypatch):
    fn, kept = _kept(monkeypatch)
    a, b = _tensors()["a"], _tensors()["b"]
    kept((3, 2), a, b, 96, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    assert len(fn.jit_calls) == 1 and fn.compiled.calls == []  # the first call: the JIT
    a2, b2 = torch.ones(64), torch.ones(64)
    kept((3, 2), a2, b2, 96, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    assert len(fn.jit_calls) == 1  # relaunched: the JIT saw nothing
    (call,) = fn.compiled.calls
    assert call[:9] == (3, 2, 1, 55, 1234, (4, 1, 0), None, None, None)
    x, y, n, scale, block, flag, extra, mode = call[9:]
    assert x is a2 and y is b2 and (n, scale, block, flag, extra, mode) == (96, 0.5, 64, True,
                                                                            None, 3)


def test_kept_launches_pass_each_calls_scalars(monkeypatch):
    """A scalar of the same specialisation (an int still divisible by 16) relaunches the
    kept kernel with this call's value: a sequence length or decoding offset may change."""
    fn, kept = _kept(monkeypatch)
    a, b = _tensors()["a"], _tensors()["b"]
    kept((3, 2), a, b, 96, 0.5, BLOCK=64, FLAG=True)
    kept((3, 2), a, b, 112, 0.25, BLOCK=64, FLAG=True)
    assert len(fn.jit_calls) == 1
    (call,) = fn.compiled.calls
    assert call[9 + 2:9 + 4] == (112, 0.25)


@pytest.mark.parametrize("change", ["int class", "int width", "scalar type", "constexpr", "grid",
                                    "dtype"])
def test_kept_launches_take_the_jit_for_another_signature(monkeypatch, change):
    fn, kept = _kept(monkeypatch)
    a, b = _tensors()["a"], _tensors()["b"]
    kept((3, 2), a, b, 96, 0.5, BLOCK=64, FLAG=True)
    args, kw, grid = [a, b, 96, 0.5], dict(BLOCK=64, FLAG=True), (3, 2)
    if change == "int class":
        args[2] = 97  # no longer divisible by 16: Triton specialises on it
    elif change == "int width":
        args[2] = 2**32  # an int64 argument
    elif change == "scalar type":
        args[3] = 1  # an int where a float was: another kernel (1 == 1.0 as a dict key)
    elif change == "constexpr":
        kw["FLAG"] = False
    elif change == "grid":
        grid = (4, 2)
    else:
        args[1] = b.double()
    kept(grid, *args, **kw)
    assert len(fn.jit_calls) == 2 and fn.compiled.calls == []
    kept(grid, *args, **kw)  # that signature is kept too
    assert len(fn.jit_calls) == 2 and len(fn.compiled.calls) == 1


def test_kept_launches_take_the_jit_when_unaligned_or_switched_off(monkeypatch):
    fn, kept = _kept(monkeypatch)
    kept((1,), *_tensors().values(), 96, 0.5, BLOCK=64, FLAG=True)
    kept((1,), *_tensors(4).values(), 96, 0.5, BLOCK=64, FLAG=True)  # b 4 bytes off
    assert len(fn.jit_calls) == 2 and fn.compiled.calls == []
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "0")
    kept((1,), *_tensors().values(), 96, 0.5, BLOCK=64, FLAG=True)
    assert len(fn.jit_calls) == 3 and fn.compiled.calls == []


def test_kept_launches_keep_nothing_on_other_devices_and_stay_bounded(monkeypatch):
    fn = _FakeJIT()
    on_gpu_only = jit_launch.KeptLaunches(fn)  # CPU tensors: the interpreter, every call
    for _ in range(2):
        on_gpu_only((1,), *_tensors().values(), 96, 0.5, BLOCK=64, FLAG=True)
    assert len(fn.jit_calls) == 2 and fn.compiled.calls == []
    interpreted = _FakeJIT()
    del interpreted.params  # TRITON_INTERPRET=1: an interpreted function, nothing compiled
    never = jit_launch.KeptLaunches(interpreted, devices=("cpu",))
    for _ in range(2):
        never((1,), *_tensors().values(), 96, 0.5, BLOCK=64, FLAG=True)
    assert len(interpreted.jit_calls) == 2
    fn, kept = _kept(monkeypatch)
    for n in range(kept.LIMIT + 3):  # a new grid every call
        kept((n + 1,), *_tensors().values(), 96, 0.5, BLOCK=64, FLAG=True)
    assert len(kept._kept) <= kept.LIMIT

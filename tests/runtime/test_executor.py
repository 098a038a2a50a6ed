"""The executor's side stream (runtime/executor.py): launches marked ``ir.SIDE`` run on a
second stream, forked from the caller's after the main launches before them and joined back
at the end of the range; here with recording fakes for the kernels, the streams and the
events (the GPU checks run the delta rule's pieced summaries on real streams)."""
import contextlib

import pytest
import torch

from forge_dist.kernels.ir import MAIN, SIDE, Buffer, Launch, Program
from forge_dist.runtime.executor import Executor

LOG = []
CURRENT = ["main"]  # the fake current stream


class _Kernel:
    """A launchable stand-in: ``kernel[grid](**args)`` logs the launch's NAME and the
    stream it was issued on."""

    def __getitem__(self, grid):
        return lambda **kw: LOG.append((kw["NAME"], CURRENT[0]))


KERNEL = _Kernel()


class _Event:
    def __init__(self, name):
        self.name = name

    def record(self, stream):
        LOG.append((f"{self.name}.record", stream))

    def wait(self, stream):
        LOG.append((f"{self.name}.wait", stream))


@contextlib.contextmanager
def _stream(stream):
    before = CURRENT[0]
    CURRENT[0] = stream
    try:
        yield
    finally:
        CURRENT[0] = before


def _program(streams):
    launches = [Launch(f"{__name__}:KERNEL", (1, 1, 1), (("x", "buf", "x"),),
                       (("NAME", f"L{i}"),), 1, 1, stream)
                for i, stream in enumerate(streams)]
    return Program(launches, {"x": Buffer((1,), torch.float32, "input")}, "fused")


@pytest.fixture
def side_executor(monkeypatch):
    """An executor of launches 0..5 (main, side, side, main, side, main) whose side
    stream, events and stream switch are the recording fakes."""
    monkeypatch.setattr(torch.cuda, "stream", _stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "main")
    exe = Executor(_program([MAIN, SIDE, SIDE, MAIN, SIDE, MAIN]), torch.device("cpu"))
    assert not exe._side_used  # on the CPU every launch runs in order on one stream
    exe._side_used = True
    exe._side = ("side", _Event("fork"), _Event("join"))
    LOG.clear()
    return exe


def test_side_launches_fork_after_the_main_launches_before_them_and_join_at_the_end(
        side_executor):
    side_executor({"x": torch.zeros(1)})
    assert LOG == [("L0", "main"),
                   ("fork.record", "main"), ("fork.wait", "side"),
                   ("L1", "side"), ("L2", "side"),
                   ("L3", "main"),
                   ("fork.record", "main"), ("fork.wait", "side"),
                   ("L4", "side"),
                   ("L5", "main"),
                   ("join.record", "side"), ("join.wait", "main")]


def test_a_range_ends_joined_and_a_range_without_side_launches_forks_nothing(side_executor):
    side_executor.run_range({"x": torch.zeros(1)}, 0, 2)  # a plan's range before its pass
    assert LOG == [("L0", "main"), ("fork.record", "main"), ("fork.wait", "side"),
                   ("L1", "side"), ("join.record", "side"), ("join.wait", "main")]
    LOG.clear()
    side_executor.run_range({"x": torch.zeros(1)}, 5, 6)
    assert LOG == [("L5", "main")]


def test_a_cpu_executor_runs_side_launches_in_order_on_one_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", _stream)
    exe = Executor(_program([MAIN, SIDE, MAIN]), torch.device("cpu"))
    LOG.clear()
    exe({"x": torch.zeros(1)})
    assert LOG == [("L0", "main"), ("L1", "main"), ("L2", "main")]

"""Named phase boundaries of a sequence-parallel call, for benchmarks and profilers.

The library marks where each phase of an op call begins and ends (docs/design.md section 3):

* :data:`CHECK` -- the cross-rank argument check (:func:`forge_dist.ops.checks.across_ranks`);
* :data:`STATE_PASS` -- the forward chain between ranks (the runner's phase 2, a
  sequence-parallel plan's ``forward_chain``);
* :data:`MERGE` -- the runner's phase 3: incoming states merged into outputs and final states;
* :data:`BACKWARD_CHAIN` -- the reverse chain inside autograd (the state pass's backward).

Nothing listens by default: then a phase costs one global read and a compare per edge
(~0.1 us per ``with`` block on a CPU core).  ``torch.profiler.record_function`` was the
alternative and costs ~4 us per range with no profiler running (torch 2.13, CPU), which
steady-state plan calls cannot afford; :func:`profiler_ranges` turns the marks into
``record_function`` ranges while a profile is taken.

A listener is ``hook(name: str, begin: bool)``, called on the calling thread at each edge;
it may record a timestamp or a CUDA event (the benchmarks do).  Hooks are process-wide::

    with phases.listen(lambda name, begin: print(name, begin)):
        ops.gla(q, k, v, g, group=group)
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Tuple

import torch

Hook = Callable[[str, bool], None]

# None while nothing listens (the fast path reads only this); else the listeners in order
_hooks: Optional[Tuple[Hook, ...]] = None


def _emit(name: str, begin: bool) -> None:
    hooks = _hooks
    if hooks is not None:
        for hook in hooks:
            hook(name, begin)


class Phase:
    """A named phase: ``with PHASE:`` around its work calls the listeners at both edges."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        if _hooks is not None:
            _emit(self.name, True)

    def __exit__(self, *exc) -> bool:
        if _hooks is not None:
            _emit(self.name, False)
        return False

    def __repr__(self) -> str:
        return f"Phase({self.name!r})"


def begin(phase: Phase) -> None:
    """The start edge of ``phase``, for code that ``torch.compile`` traces (Dynamo cannot
    enter a user-defined context manager; it folds this call away while nothing listens)."""
    if _hooks is not None:
        _emit(phase.name, True)


def end(phase: Phase) -> None:
    """The end edge of ``phase`` (see :func:`begin`)."""
    if _hooks is not None:
        _emit(phase.name, False)


CHECK = Phase("check")
STATE_PASS = Phase("state_pass")
MERGE = Phase("merge")
BACKWARD_CHAIN = Phase("backward_chain")
NAMES = (CHECK.name, STATE_PASS.name, MERGE.name, BACKWARD_CHAIN.name)


def listening() -> bool:
    """Whether any listener is installed."""
    return _hooks is not None


@contextlib.contextmanager
def listen(hook: Hook) -> Iterator[Hook]:
    """Call ``hook(name, begin)`` at every phase edge inside the block (nests; process-wide)."""
    global _hooks
    _hooks = (_hooks or ()) + (hook,)
    try:
        yield hook
    finally:
        rest = tuple(h for h in (_hooks or ()) if h is not hook)
        _hooks = rest or None


@contextlib.contextmanager
def profiler_ranges(prefix: str = "forge_dist::") -> Iterator[None]:
    """Inside the block, each phase is also a ``torch.profiler.record_function`` range named
    ``<prefix><phase>`` (visible in ``torch.profiler`` traces and, through NVTX, in Nsight)."""
    open_ranges = {}

    def hook(name: str, begin: bool) -> None:
        if begin:
            rf = torch.profiler.record_function(prefix + name)
            rf.__enter__()
            open_ranges.setdefault(name, []).append(rf)
        elif open_ranges.get(name):
            open_ranges[name].pop().__exit__(None, None, None)

    with listen(hook):
        yield

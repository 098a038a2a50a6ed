"""The executor of one launch program: JIT launches, or bound cubins where available.

:class:`Executor` runs a :class:`~forge_dist.kernels.ir.Program` (the launches the kernel
modules describe) on tensors given by buffer name: through the static dispatcher's bound
cubins where the AOT cache has them, else through Triton's JIT, relaunching the kernel the
first call compiled (:mod:`forge_dist.kernels.jit_launch`); once every launch has one or the
other, calls go through straight-line code made for the program (:mod:`.fastpath`).  The plan's workspaces
live here, so their pointers are fixed for the plan's life.  :class:`BoundRun` is the same
launches bound to fixed buffers (:meth:`.plan.Plan.bind`).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.ir import SIDE, Program, resolve_kernel
from ..kernels import jit_launch
from . import fastpath
from .dispatcher import current_stream_fn


class Executor:
    """Runs one :class:`~forge_dist.kernels.ir.Program`: JIT launches, or bound cubins
    where available."""

    def __init__(self, program: Program, device: torch.device, dispatcher=None,
                 specialise: bool = False):
        self.program = program
        self.device = device
        self.kernels = [resolve_kernel(ln.kernel) for ln in program.launches]
        self.bound: List[Any] = [None] * len(program.launches)
        self.paths: List[str] = ["jit"] * len(program.launches)
        self.workspaces: Dict[str, Tensor] = {}
        for name, buf in program.buffers.items():
            if buf.role == "workspace":
                self.workspaces[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
        self.stream = None
        if dispatcher is not None:
            stream_fn = getattr(dispatcher, "stream_fn", None) or current_stream_fn
            for i, ln in enumerate(program.launches):
                spec = ln.spec(program.buffers)
                b = dispatcher.bind(ln, program.buffers, device.index or 0)
                self.bound[i] = b
                self.paths[i] = (f"cubin {spec.key}" if b is not None else
                                 f"jit ({dispatcher.cache.stale(spec.key)})")
            self.stream = stream_fn(device.index or 0)
        self._ws_ptrs = {n: t.data_ptr() for n, t in self.workspaces.items()}
        for b in self.bound:  # workspaces live as long as the plan: their pointers are fixed
            if b is not None:
                b.bake(self._ws_ptrs)
        self._jit_calls = []
        for ln, fn in zip(program.launches, self.kernels):
            kw = dict(ln.constexprs)
            kw.update(num_warps=ln.num_warps, num_stages=ln.num_stages)
            self._jit_calls.append((fn[ln.grid], ln.args, kw))
        # JIT launches relaunch the kernel their first call compiled (jit_launch.py)
        self._compiled: List[Any] = [None] * len(program.launches)
        self._untried = [device.type == "cuda" and b is None for b in self.bound]
        # programs with per-call scratch (the backward programs) allocate and drop it per call
        self._scoped = any(b.role == "scratch" for b in program.buffers.values())
        # specialise: once every launch has a cubin or a compiled kernel, calls go through
        # straight-line code made for this program (fastpath.specialise_program)
        self._specialise_pending = specialise
        self._fast: Optional[Callable[[Dict[str, Tensor]], None]] = None
        # launches on a second stream (ir.SIDE): on a GPU they run there, forked from the
        # caller's stream before each run of them and joined at the end of a range; not
        # where a dispatcher sends the launches to a stream of its own (the fork and join
        # events are recorded on the caller's stream)
        self.on_side = [ln.stream == SIDE for ln in program.launches]
        self._side_used = (device.type == "cuda" and any(self.on_side)
                           and getattr(dispatcher, "stream_fn", None) is None)
        self._side: Optional[Tuple[Any, Any, Any]] = None

    def __call__(self, tensors: Dict[str, Tensor]) -> None:
        """Launch the program on ``tensors`` (its inputs and outputs by buffer name).  A
        program with scratch buffers also gets each output and scratch buffer that
        ``tensors`` lacks allocated just before its first launch, and its scratch dropped
        after its last (so that a backward's peak memory is its kernels' own)."""
        fast = self._fast
        if fast is not None:
            fast(tensors)  # calls _call_general on anything it does not take
            return
        self._call_general(tensors)
        if self._specialise_pending and not any(self._untried):
            self._specialise_pending = False  # one try: a launch without either stays JIT
            self._fast = fastpath.specialise_program(self)

    def run_range(self, tensors: Dict[str, Tensor], start: int, stop: int) -> None:
        """Launch ``program.launches[start:stop]`` on ``tensors``: a sequence-parallel plan
        runs its state pass between its summaries and its output walks.  Programs without
        per-call scratch only (the forward programs)."""
        if self._scoped:
            raise RuntimeError("run_range: a program with scratch buffers runs whole")
        self._launch(tensors, range(start, stop))

    def _call_general(self, tensors: Dict[str, Tensor]) -> None:
        if not self._scoped:
            self._launch(tensors, range(len(self._jit_calls)))
            return
        fast_ok = None if self.device.type != "cuda" else jit_launch.usable()
        self.program.run_scoped(tensors, self.device,
                                lambda i, t: self._launch(t, (i,), fast_ok))

    def side_stream(self) -> Tuple[Any, Any, Any]:
        """``(stream, fork, join)``: the stream this program's side launches run on (high
        priority: they are a sequence-parallel rank's summary, on the chain's critical path)
        and the events that fork it from the caller's stream and join it back; made once."""
        if self._side is None:
            self._side = (torch.cuda.Stream(self.device, priority=-1), torch.cuda.Event(),
                          torch.cuda.Event())
        return self._side

    def _launch(self, tensors: Dict[str, Tensor], which, fast_ok: Optional[bool] = None) -> None:
        """Launch ``which`` (indices into the program) on ``tensors``; ``fast_ok``: whether
        compiled kernels may be relaunched (read from the environment when ``None``).  Side
        launches go to :meth:`side_stream`, each run of them forked from the caller's stream
        after the main launches before it; the caller's stream waits for them at the end."""
        if not self._side_used:
            self._launch_here(tensors, which, fast_ok)
            return
        side, fork, join = self.side_stream()
        main = torch.cuda.current_stream(self.device)
        forked = False
        for on_side, run in itertools.groupby(which, key=self.on_side.__getitem__):
            if on_side:
                fork.record(main)
                fork.wait(side)
                with torch.cuda.stream(side):
                    self._launch_here(tensors, run, fast_ok)
                forked = True
            else:
                self._launch_here(tensors, run, fast_ok)
        if forked:
            join.record(side)
            join.wait(main)

    def _launch_here(self, tensors: Dict[str, Tensor], which, fast_ok: Optional[bool]) -> None:
        """Launch ``which`` on the current stream (see :meth:`_launch`)."""
        ptrs = merged = None
        for i in which:
            launch, args, kw = self._jit_calls[i]
            b = self.bound[i]
            if b is not None:
                if ptrs is None:
                    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
                b.launch(ptrs, self.stream())
                continue
            fast = self._compiled[i]
            if fast is not None or self._untried[i]:
                if merged is None:
                    merged = {**self.workspaces, **tensors} if self.workspaces else tensors
                if fast_ok is None:  # reads the environment: only where a JIT launch runs
                    fast_ok = jit_launch.usable()
                if fast is not None and fast_ok and fast.aligned(merged):
                    fast(merged, jit_launch.raw_stream(self.device.index))
                    continue
            call = {}
            for name, kind, value in args:
                if kind == "buf":
                    call[name] = tensors[value] if value in tensors else self.workspaces[value]
                else:
                    call[name] = value
            kernel = launch(**call, **kw)
            if self._untried[i]:
                self._untried[i] = False
                ln = self.program.launches[i]
                self._compiled[i] = jit_launch.CompiledLaunch.make(
                    kernel, self.kernels[i], ln.grid, args, dict(ln.constexprs), merged)


class BoundRun:
    """A plan's launches bound to fixed buffers (:meth:`.plan.Plan.bind`); call it to launch."""

    def __init__(self, exe: "Executor", tensors: Dict[str, Tensor], outputs):
        self._tensors = tensors  # keeps the bound buffers alive
        self._exe = exe  # and the plan's workspaces, whose pointers the packs hold
        self.outputs = outputs
        ptrs = {n: t.data_ptr() for n, t in tensors.items()}
        steps = []
        for (launch, args, kw), b in zip(exe._jit_calls, exe.bound):
            if b is not None:
                # each bound launch keeps its own packed copy (a plan's packs are shared
                # with its run()), so run() between calls cannot change what we launch
                pack = type(b.pack)(b.pack.types)
                pack.pack(b.values(ptrs))
                steps.append((b.driver.launch, (b.fn, b.grid, b.block_x, b.shared), pack))
            else:
                call = {name: (tensors[value] if value in tensors else exe.workspaces[value])
                        if kind == "buf" else value for name, kind, value in args}
                steps.append((launch, call, kw))
        self._steps = steps
        self._stream = exe.stream

    def __call__(self):
        """Launch on the current stream; returns ``outputs``."""
        for fn, a, b in self._steps:
            if type(a) is tuple:
                fn(*a, self._stream(), b.params_address)
            else:
                fn(**a, **b)
        return self.outputs

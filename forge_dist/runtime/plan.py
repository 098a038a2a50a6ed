"""Plan once, run many times (FlashInfer style).

``p = plan("simple_gla", B=1, T=4096, H=32, K=128, V=128, dtype=torch.bfloat16)`` fixes, once:
shapes and dtypes, the execution strategy (fused/decoupled, from the kernels' scheduler),
the tile configs (the kernels' tables), the launch program (:func:`forge_dist.kernels.forward_program`), the
workspaces, the kernels (cubins bound to the static dispatcher, or the JIT kernels), and
for sequence parallelism the strategy object, its symmetric buffers (forge) and the
cross-rank agreement check.  ``o, final = p.run(q, k, v, g)`` then only checks each tensor
against the plan (shape, dtype, device, contiguity, alignment: no collective, no host sync)
and launches.

Backends (``backend=``):

* ``"static"``: cubins from the AOT cache launched through the CUDA driver
  (:mod:`.dispatcher`); a launch whose cubin is missing or stale runs through the JIT (see
  :meth:`Plan.describe`).
* ``"triton"``: the same launches through Triton's JIT (CUDA, or CPU tensors under
  ``TRITON_INTERPRET=1``).
* ``"torch"``: the PyTorch chunk form through :mod:`forge_dist.ops` (CPU without Triton).
* ``"auto"``: static on CUDA when the cache has valid cubins, else triton; on CPU triton
  under the interpreter, else torch.

JIT launches call the kernel their first call compiled directly after that call
(:mod:`.jit_launch`), so a plan without cubins also skips Triton's per-call path.
Single-device plans also have :meth:`Plan.run_backward`, the gradients of a run (hgrn from
the run's outputs, which are its states; the matrix-state ops from its inputs, recomputing
the chunk states as their backward kernels do), which the ops wrap in autograd.

``run`` is forward-only (no autograd) and CUDA-graph capturable on one GPU: it allocates only
its outputs (``torch.empty``, which capture serves from the graph's pool; pass ``out=`` to
reuse a buffer), never reads a device value on the host, never synchronises, and launches on
the current stream.  A plan's workspaces are reused by every call, so one plan must not run
concurrently on two streams.  Sequence-parallel plans with strategy ``forge`` are
capturable too (device-side epochs; see ``forge_dist/runtime/__init__.py``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import fastpath, jit_launch
from .. import kernels
from ..kernels.ir import Program, resolve_kernel

_KIND = {"linear_attn": "identity", "simple_gla": "scalar", "gla": "diagonal"}
SP_VARIANTS = tuple(_KIND)


class PlanError(ValueError):
    """A plan cannot be made, or a tensor does not match the plan it is run with."""


def _raw_stream(index: int) -> int:
    """The current CUDA stream's handle, as Triton's launcher reads it."""
    return torch._C._cuda_getCurrentRawStream(index)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _rank_size(group) -> Tuple[int, int, bool]:
    """``(rank, size, simulated)`` for ``None``, a process group or a ``SimRank``."""
    if group is None:
        return 0, 1, False
    from ..comm.channel import SimRank

    if isinstance(group, SimRank):
        return group.rank, group.world.size, True
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group), False


class _Exec:
    """Runs one :class:`~forge_dist.kernels.ir.Program`: JIT launches, or bound cubins where available."""

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
            from .dispatcher import current_stream_fn

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

    def _call_general(self, tensors: Dict[str, Tensor]) -> None:
        if not self._scoped:
            self._launch(tensors, range(len(self._jit_calls)))
            return
        fast_ok = None if self.device.type != "cuda" else jit_launch.usable()
        self.program.run_scoped(tensors, self.device,
                                lambda i, t: self._launch(t, (i,), fast_ok))

    def _launch(self, tensors: Dict[str, Tensor], which, fast_ok: Optional[bool] = None) -> None:
        """Launch ``which`` (indices into the program) on ``tensors``; ``fast_ok``: whether
        compiled kernels may be relaunched (read from the environment when ``None``)."""
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
                    fast(merged, _raw_stream(self.device.index))
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
    """A plan's launches bound to fixed buffers (:meth:`Plan.bind`); call it to launch."""

    def __init__(self, exe: "_Exec", tensors: Dict[str, Tensor], outputs):
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


class Plan:
    """A planned op call; make one with :func:`plan`.

    Not thread-safe: every run reuses the plan's workspaces and launch parameter buffers,
    so two threads (or two streams) must not run one plan at the same time; make one plan
    per thread and stream (the ops' plan cache keys on both)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    # -- run -------------------------------------------------------------------------------
    def _check(self, name: str, t, shape, dtype) -> None:
        if not isinstance(t, Tensor):
            raise PlanError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise PlanError(f"{name}: the plan was made for shape {shape}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise PlanError(f"{name}: the plan was made for dtype {dtype}, got {t.dtype}")
        if t.device != self.device:
            raise PlanError(f"{name}: the plan was made for device {self.device}, got {t.device}")
        if not t.is_contiguous():
            raise PlanError(f"{name}: expected a contiguous tensor (plans launch on raw "
                            "pointers); call .contiguous() first")
        if self.static and t.data_ptr() % 16:
            raise PlanError(f"{name}: data pointer not 16-byte aligned (the cubins assume it)")

    def _check_state_and_grad(self, inputs, initial_state) -> None:
        """``initial_state`` as the plan was made, and no input that needs a gradient."""
        if self.initial_state:
            if initial_state is None:
                raise PlanError("initial_state: the plan was made with initial_state=True; "
                                "pass it (or make a plan without)")
            self._check("initial_state", initial_state, self.state_shape, torch.float32)
        elif initial_state is not None:
            raise PlanError("initial_state: the plan was made with initial_state=False")
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            raise PlanError("plans are forward-only; use forge_dist.ops (differentiable) "
                            "for training, or run under torch.no_grad()")

    def run(self, *inputs: Tensor, initial_state: Optional[Tensor] = None,
            out: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """Launch the planned call; returns ``(o, final_state or None)``.

        Args:
            inputs: in the plan's order, ``plan.input_names`` (e.g. ``q, k, v, g``).
            initial_state: required iff the plan was made with ``initial_state=True``.
            out: optional output buffer for ``o`` (same checks as the inputs).
        """
        names = self.input_names
        if len(inputs) != len(names):
            raise PlanError(f"run: expected {len(names)} inputs ({', '.join(names)}), got "
                            f"{len(inputs)}")
        tensors: Dict[str, Tensor] = {}
        device, static, shapes, dtypes = self.device, self.static, self.shapes, self.dtypes
        for n, t in zip(names, inputs):
            # the common case in one expression (this runs on every call); any miss goes
            # through _check, which names what is wrong
            if not (isinstance(t, Tensor) and t.shape == shapes[n] and t.dtype == dtypes[n]
                    and t.device == device and t.is_contiguous()
                    and not (static and t.data_ptr() % 16)):
                self._check(n, t, shapes[n], dtypes[n])
            tensors[n] = t
        self._check_state_and_grad(inputs, initial_state)
        if self.backend == "torch":
            return self._run_torch(tensors, initial_state)
        if out is not None:
            self._check("out", out, self.out_shape, self.out_dtype)
        o = out if out is not None else torch.empty(self.out_shape, dtype=self.out_dtype,
                                                    device=self.device)
        if self.size == 1:
            return self._run_local(tensors, initial_state, o)
        return self._run_sp(tensors, initial_state, o)

    # the general path; plan() replaces a qualifying plan's ``run`` with a function
    # specialised to it (:mod:`.fastpath`), which calls this one on anything unusual
    _run_general = run

    def __call__(self, *inputs: Tensor, **kw):
        return self.run(*inputs, **kw)

    def bind(self, *inputs: Tensor, initial_state: Optional[Tensor] = None,
             out: Optional[Tensor] = None, final_state: Optional[Tensor] = None) -> "BoundRun":
        """Check these buffers once and return a call that launches on them: ``BoundRun()``.

        For loops that keep their tensors and refill them in place (decoding, evaluation,
        benchmarks), as a CUDA graph would, without a capture: each call packs nothing
        and only launches the plan's kernels on the current stream (cubins through the driver;
        a launch without a cubin goes through the JIT).  Single-device plans; a
        sequence-parallel plan is replayed through a CUDA graph instead.

        Args: as :meth:`run`; ``out`` ``[B, T, H, V]`` and ``final_state`` (the plan's
        state shape, fp32) are allocated here when not given.  The returned object keeps
        every tensor alive; ``BoundRun.outputs`` is ``(o, final_state or None)``.
        """
        if self.size != 1:
            raise PlanError("bind: single-device plans only (capture a sequence-parallel "
                            "plan's run in a CUDA graph to replay it)")
        if self.backend == "torch":
            raise PlanError("bind: the torch backend has no launches to bind; use run()")
        if len(inputs) != len(self.input_names):
            raise PlanError(f"bind: expected {len(self.input_names)} inputs "
                            f"({', '.join(self.input_names)}), got {len(inputs)}")
        tensors: Dict[str, Tensor] = {}
        for n, t in zip(self.input_names, inputs):
            self._check(n, t, self.shapes[n], self.dtypes[n])
            tensors[n] = t
        self._check_state_and_grad(inputs, initial_state)
        if initial_state is not None:
            tensors["h0"] = initial_state
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        self._check("out", out, self.out_shape, self.out_dtype)
        if final_state is None:
            final_state = (torch.empty(self.ht_shape, dtype=torch.float32, device=self.device)
                           if self.output_final_state else self._ht_scratch)
        self._check("final_state", final_state, tuple(self.ht_shape), torch.float32)
        tensors["o"], tensors["ht"] = out, final_state
        return BoundRun(self.finish_exec, tensors,
                        (out, final_state if self.output_final_state else None))

    def run_backward(self, *tensors: Tensor, dht: Optional[Tensor] = None,
                     initial_state: Optional[Tensor] = None, need_initial_grad: bool = False
                     ) -> Tuple[Optional[Tensor], ...]:
        """Gradients of one :meth:`run` of a single-device plan: those of the plan's inputs
        in ``input_names`` order, then ``dS_in`` (the gradient of ``initial_state``, or
        ``None``).  Gradients come in their inputs' dtypes.

        Args:
            tensors: hgrn: ``(g, o, do)``, the gates the run took, its outputs (hgrn's
                outputs are its states, so nothing is recomputed) and their gradient; the
                matrix-state ops: ``(*inputs, do)``, the inputs the run took (the backward
                recomputes the chunk states from them, as the ops' backward does) and the
                gradient of ``o``.  ``do``: ``o``'s shape and dtype.
            dht: the gradient of the final state (the plan's state shape, fp32), or ``None``.
            initial_state: the state the run took (required iff the plan has one).
            need_initial_grad: also return ``dS_in``.
        Launches only, like :meth:`run` (per-call buffers come from PyTorch's allocator);
        the backward programs (with and without ``dht``) are built on first use, which a
        graph capture may be (their workspaces then come from the graph's pool).
        """
        if self.size != 1 or self.backend == "torch":
            raise PlanError("run_backward: single-device plans on the Triton or static backend "
                            f"only (this plan: {self.op}, backend {self.backend}, world "
                            f"{self.size}); use forge_dist.ops for gradients")
        if self.prologues:
            raise PlanError(f"run_backward: this plan maps {', '.join(self.prologues)} with "
                            "fused prologues, which the backward programs do not differentiate; "
                            "use forge_dist.ops (or the DSL's variant) for gradients")
        hgrn = self.op == "hgrn"
        names = ("g", "o", "do") if hgrn else tuple(self.input_names) + ("do",)
        if len(tensors) != len(names):
            raise PlanError(f"run_backward: expected {len(names)} tensors ({', '.join(names)}), "
                            f"got {len(tensors)}")
        *inputs, do = tensors
        if hgrn:  # the backward program's names: the kept outputs are the states h
            shapes = {"g": self.out_shape, "h": self.out_shape}
            dtypes = {"g": self.dtypes["g"], "h": self.out_dtype}
            given = dict(zip(("g", "h"), inputs))
        else:
            shapes, dtypes, given = self.shapes, self.dtypes, dict(zip(self.input_names, inputs))
        device, static = self.device, self.static
        for name, t in list(given.items()) + [("do", do)]:
            shape, dtype = (self.out_shape, self.out_dtype) if name == "do" else (
                shapes[name], dtypes[name])
            # the common case in one expression, as in run; a miss names what is wrong
            if not (type(t) is Tensor and t.shape == shape and t.dtype == dtype
                    and t.device == device and t.is_contiguous()
                    and not (static and t.data_ptr() % 16)):
                self._check("o" if name == "h" else name, t, shape, dtype)
        if self.initial_state:
            if initial_state is None:
                raise PlanError("initial_state: the plan was made with initial_state=True; "
                                "pass the state its run took")
            self._check("initial_state", initial_state, self.state_shape, torch.float32)
            given["h0"] = initial_state
        elif initial_state is not None:
            raise PlanError("initial_state: the plan was made with initial_state=False")
        if dht is not None:
            self._check("dht", dht, self.state_shape, torch.float32)
            given["dht"] = dht
        given["do"] = do
        exe = self._backward_exec(dht is not None)
        if hgrn:
            given["dx"] = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
            given["dg"] = torch.empty(self.out_shape, dtype=self.dtypes["g"],
                                      device=self.device)
            exe(given)
            dS = (exe.workspaces["cout"][0].clone() if need_initial_grad and self.initial_state
                  else None)
            return given["dx"], given["dg"], dS
        g = given.get("g")
        if g is not None and g.dtype != torch.float32:  # the backward kernels read fp32 gates
            given["g"] = g.float()
        exe(given)  # allocates the gradients and the scratch it needs, drops the scratch
        if "dg_part" in given:  # simple_gla: the K tiles' shares of dg
            from ..kernels.scalar_backward import summed_gate_grad

            given["dg"] = summed_gate_grad(given["dg_part"])
        grads = [given["dq"], given["dk"], given["dv"]]
        if g is not None:
            grads.append(given["dg"].to(g.dtype))
        if self.op == "gated_delta_rule":
            grads.append(given["dbeta"].to(self.dtypes["beta"]))
        grads.append(given.get("dh0") if need_initial_grad else None)
        return tuple(grads)

    def _backward_exec(self, has_dht: bool) -> "_Exec":
        exe = self._bwd_execs.get(has_dht)
        if exe is None:
            if self.op == "hgrn":
                B, T, D = self.out_shape
                prog = kernels.backward_program(
                    "hgrn", B=B, T=T, D=D, dtype=self.out_dtype, gate_dtype=self.dtypes["g"],
                    has_h0=self.initial_state, has_dht=has_dht,
                    execution=self.execution_request)
            else:
                from ..kernels.scalar_backward import sm_count

                B, T, H, K = self.shapes["q"]
                prog = kernels.backward_program(
                    self.op, B=B, T=T, H=H, K=K, V=self.out_shape[-1], dtype=self.out_dtype,
                    gated="g" in self.shapes, has_h0=self.initial_state, has_dht=has_dht,
                    scale=self.scale, interp=self._interp,
                    beta_dtype=self.dtypes.get("beta", torch.float32),
                    sms=sm_count(self.device))
            exe = self._bwd_execs[has_dht] = _Exec(prog, self.device, self._dispatcher,
                                                   specialise=True)
            self.notes.extend(n for n in prog.notes if n not in self.notes)
        return exe

    def _run_local(self, tensors, h0, o):
        if self.output_final_state:
            ht = torch.empty(self.ht_shape, dtype=torch.float32, device=self.device)
        else:  # nobody sees it: the plan's scratch
            ht = self._ht_scratch
        tensors["o"], tensors["ht"] = o, ht
        if h0 is not None:
            tensors["h0"] = h0
        self.finish_exec(tensors)
        if self._specialise_pending:
            self._specialise_compiled()
        return o, (self._final(ht) if self.output_final_state else None)

    def _specialise_compiled(self) -> None:
        """Triton plans on a GPU: once the JIT has compiled every launch (the first run),
        ``run`` becomes the function specialised to those kernels (:mod:`.fastpath`)."""
        exe = self.finish_exec
        if all(c is not None for c in exe._compiled):
            self._specialise_pending = False
            fast = fastpath.specialise(self)
            if fast is not None:
                self.run = fast
        elif not any(exe._untried):  # a launch the relaunch cannot keep: JIT every call
            self._specialise_pending = False

    def _run_sp(self, tensors, h0, o):
        from ..variants.transitions import Kind

        kind = Kind(self.kind)
        rank, size = self.rank, self.size
        M = None
        if rank < size - 1:
            local = dict(tensors)
            local["ht"] = self.delta
            self.summary_exec(local)
            g = tensors.get("g")
            if kind is not Kind.IDENTITY:
                M = g.sum(dim=1, dtype=torch.float32).exp()  # [B, H] or [B, H, K]
            delta = self.delta
        else:
            delta = self.zeros  # nobody reads the last rank's carry
        S0 = (h0 if h0 is not None else self.zeros) if rank == 0 else self.zeros
        S_in, _ = self.strategy_obj.forward_chain(kind, M, delta, S0, self.group)
        ht = torch.empty(self.ht_shape, dtype=torch.float32, device=self.device)
        tensors["o"], tensors["ht"] = o, ht
        if rank == 0:
            if h0 is not None:
                tensors["h0"] = h0
        else:
            tensors["h0"] = S_in
        self.finish_exec(tensors)
        return o, (ht if self.output_final_state else None)

    def _final(self, ht):
        return ht

    def _run_torch(self, tensors, h0):
        from .. import ops

        fn = getattr(ops, self.op)
        kw = dict(initial_state=h0, output_final_state=self.output_final_state)
        if self.op != "hgrn":
            kw["scale"] = self.scale
        if self.op == "gated_delta_rule":
            return fn(tensors["q"], tensors["k"], tensors["v"], tensors.get("g"),
                      tensors["beta"], **kw)
        return fn(*[tensors[n] for n in self.input_names], **kw)

    # -- reporting -------------------------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        """What the plan fixed: shapes, dtypes, backend, strategy, execution, launches."""
        def launches(ex):
            if ex is None:
                return []
            return [{"kernel": ln.kernel, "grid": list(ln.grid), "num_warps": ln.num_warps,
                     "num_stages": ln.num_stages,
                     "constexprs": {k: v for k, v in ln.constexprs},
                     "path": path}
                    for ln, path in zip(ex.program.launches, ex.paths)]
        ws = {}
        for ex in (self.finish_exec, self.summary_exec, *self._bwd_execs.values()):
            if ex is not None:
                ws.update({n: list(t.shape) for n, t in ex.workspaces.items()})
        return {"op": self.op, "backend": self.backend, "device": str(self.device),
                "inputs": {n: {"shape": list(self.shapes[n]), "dtype": str(self.dtypes[n])}
                           for n in self.input_names},
                "initial_state": self.initial_state,
                "output_final_state": self.output_final_state, "scale": self.scale,
                "world_size": self.size, "rank": self.rank,
                "strategy": self.strategy if self.size > 1 else None,
                "execution": self.execution, "notes": list(self.notes),
                "launches": launches(self.finish_exec),
                "summary_launches": launches(self.summary_exec),
                "backward_launches": {("with dht" if k else "without dht"): launches(ex)
                                      for k, ex in self._bwd_execs.items()},
                "workspaces": ws, "channels": self.channels}

    def __repr__(self) -> str:
        d = self.describe()
        return (f"Plan({d['op']}, backend={d['backend']}, execution={d['execution']}, "
                f"world={d['world_size']}, launches={[x['kernel'] for x in d['launches']]})")


def _static_cache(device: torch.device, cache_dir):
    from .aot import CubinCache, default_cache_dir

    major, minor = torch.cuda.get_device_capability(device)
    return CubinCache(cache_dir if cache_dir is not None else default_cache_dir(),
                      target=f"cuda:{major}{minor}")


def plan(op: str, *, B: int, T: int, H: Optional[int] = None, K: Optional[int] = None,
         V: Optional[int] = None, D: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
         gate_dtype: Optional[torch.dtype] = None, gated: Optional[bool] = None,
         beta_dtype: Optional[torch.dtype] = None, initial_state: bool = False,
         output_final_state: bool = False, scale: Optional[float] = None, device=None,
         group=None, strategy: str = "auto",
         execution: Optional[str] = None, backend: str = "auto", cache_dir=None,
         tiles: Optional[dict] = None, dispatcher=None, maps=None) -> Plan:
    """Plan one op call; see the module docstring.

    Args:
        op: ``linear_attn``, ``simple_gla``, ``gla``, ``gated_delta_rule`` or ``hgrn``.
        B, T: batch and tokens per rank; H, K, V: heads and head dims (hgrn: ``D``).
        dtype: of q/k/v (hgrn x); ``gate_dtype`` of g/beta (default fp32; hgrn: ``dtype``);
            ``beta_dtype`` of gated_delta_rule's beta when it differs from g's.
        gated: simple_gla / gated_delta_rule with a ``g`` input (default True); linear_attn
            never, gla always.
        initial_state / output_final_state: whether run takes / returns the fp32 state.
        group: ``None``, a process group, or a ``forge_dist.comm.sim.SimRank``.
        strategy: sequence-parallel strategy (``forge``, ``lasp2``, ...; ``auto``).
        execution: ``fused`` / ``decoupled`` / ``None`` (the kernels' scheduler).
        backend: ``auto``, ``static``, ``triton`` or ``torch``.
        cache_dir: AOT cache for the static backend (default: ``FORGE_DIST_AOT_CACHE`` or
            ``~/.cache/forge_dist/aot``).
        tiles: overrides of the kernels' tile config (e.g. ``{"BT": 32}``).
        dispatcher: a :class:`~.dispatcher.Dispatcher` to use (tests inject fakes).
        maps: fused elementwise prologues, input name -> jitted map (a dict or its items;
            :mod:`forge_dist.dsl.codegen`): the kernels map each input as they load it.
            JIT-launched (the AOT cache holds no such kernels); not for gated_delta_rule.
    """
    maps = {n: m for n, m in dict(maps or {}).items() if m is not None}
    if op not in kernels.VARIANTS:
        raise PlanError(f"op: expected one of {kernels.VARIANTS}, got {op!r}")
    if backend not in ("auto", "static", "triton", "torch"):
        raise PlanError(f"backend: expected auto, static, triton or torch, got {backend!r}")
    if execution not in (None, "auto", "fused", "decoupled"):
        raise PlanError(f"execution: expected fused, decoupled or None, got {execution!r}")
    for name, val in (("B", B), ("T", T)):
        if not isinstance(val, int) or val < 1:
            raise PlanError(f"{name}: expected a positive int, got {val!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise PlanError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rank, size, simulated = _rank_size(group)

    if backend == "auto":
        if device.type == "cuda":
            backend = "static" if dispatcher is not None else "triton"
            if dispatcher is None:
                cache = _static_cache(device, cache_dir)
                if any(cache.stale(k) is None for k in cache._all):
                    backend = "static"
        else:
            backend = "triton" if _interpreting() else "torch"
    if backend in ("static", "triton") and device.type != "cuda" and not _interpreting():
        if not (backend == "static" and dispatcher is not None):
            raise PlanError(f"backend={backend!r}: tensors on {device} need CUDA, or "
                            "TRITON_INTERPRET=1 set before Triton is imported")
    if size > 1 and op not in SP_VARIANTS:
        raise PlanError(f"group: sequence-parallel plans cover {SP_VARIANTS}; use "
                        f"forge_dist.ops.{op} for {op} across ranks")
    if size > 1 and backend == "torch":
        raise PlanError("backend='torch' plans are single-rank; use forge_dist.ops with a group")

    # programs for the interpreter use its precision rule; static plans are built for the GPU
    interp = backend != "static" and _interpreting() and device.type != "cuda"
    notes: List[str] = []
    if op == "hgrn":
        if D is None or D < 1:
            raise PlanError("hgrn: give D (the feature dim of x [B, T, D])")
        gdt = gate_dtype or dtype
        if set(maps) - {"x", "g"}:
            raise PlanError(f"maps: hgrn maps x and g, got {sorted(maps)}")
        prog = kernels.forward_program("hgrn", B=B, T=T, D=D, dtype=dtype,
                                       has_h0=initial_state, tiles=tiles, gate_dtype=gdt,
                                       execution=execution, maps=maps)
        names = ["x", "g"]
        state_shape = (B, D)
        out_shape = (B, T, D)
        sm_prog = None
    else:
        for name, val in (("H", H), ("K", K), ("V", V)):
            if not isinstance(val, int) or val < 1:
                raise PlanError(f"{name}: expected a positive int, got {val!r}")
        if K < 16 or V < 16 or K > 256 or V > 256:
            raise PlanError(f"head dims K={K}, V={V} outside [16, 256] (the kernels' range)")
        if gated is None:
            gated = op != "linear_attn"
        gdt = gate_dtype or torch.float32
        scale = K ** -0.5 if scale is None else float(scale)
        try:
            prog = kernels.forward_program(
                op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, gated=gated,
                has_h0=initial_state or rank > 0, scale=scale, execution=execution,
                interp=interp, tiles=tiles, gate_dtype=gdt, beta_dtype=beta_dtype, maps=maps)
            sm_prog = None
            if size > 1 and rank < size - 1:
                sm_prog = kernels.forward_program(
                    op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, gated=gated, has_h0=False,
                    store_o=False, scale=scale, interp=interp, tiles=tiles, gate_dtype=gdt,
                    beta_dtype=beta_dtype, maps=maps)
        except ValueError as err:
            raise PlanError(str(err)) from None
        names = ["q", "k", "v"] + (["g"] if gated else []) + (
            ["beta"] if op == "gated_delta_rule" else [])
        state_shape = (B, H, K, V)
        out_shape = (B, T, H, V)
    notes.extend(prog.notes)
    if maps:
        notes.append(f"fused prologues on {', '.join(sorted(maps))}")

    if backend == "static" and dispatcher is None:
        from .dispatcher import Dispatcher

        dispatcher = Dispatcher(_static_cache(device, cache_dir))
    disp = dispatcher if backend == "static" else None
    finish_exec = summary_exec = None
    if backend != "torch":
        finish_exec = _Exec(prog, device, disp)
        summary_exec = _Exec(sm_prog, device, disp) if sm_prog is not None else None
        if disp is not None:
            jit = [p for ex in (finish_exec, summary_exec) if ex for p in ex.paths
                   if p.startswith("jit")]
            if jit:
                notes.append(f"{len(jit)} launch(es) fall back to the JIT: {jit}")

    shapes = {n: prog.buffers[n].shape for n in names}
    dtypes = {n: prog.buffers[n].dtype for n in names}
    p = Plan(op=op, backend=backend, device=device, input_names=names, shapes=shapes,
             dtypes=dtypes, initial_state=bool(initial_state),
             output_final_state=bool(output_final_state), scale=scale,
             state_shape=state_shape, ht_shape=prog.buffers["ht"].shape, out_shape=out_shape,
             out_dtype=dtype, execution=prog.execution, notes=notes, rank=rank, size=size,
             group=group, strategy=None, strategy_obj=None, kind=_KIND.get(op),
             finish_exec=finish_exec, summary_exec=summary_exec, channels=None,
             static=backend == "static", delta=None, zeros=None, _ht_scratch=None,
             execution_request=execution, _dispatcher=disp, _bwd_execs={}, _interp=interp,
             prologues=tuple(sorted(maps)),
             _specialise_pending=(backend == "triton" and device.type == "cuda"
                                  and size == 1))

    if size == 1 and backend != "torch" and not output_final_state:
        # the kernels write a final state nobody returns: one scratch for every run
        p._ht_scratch = torch.empty(p.ht_shape, dtype=torch.float32, device=device)
    if size > 1:
        _plan_sp(p, strategy, simulated, B, T, H, K, V, dtype, gated)
    fast = fastpath.specialise(p)
    if fast is not None:
        p.run = fast  # straight-line checks and launches; the general path on any miss
    return p


def _plan_sp(p: Plan, strategy: str, simulated: bool, B, T, H, K, V, dtype, gated) -> None:
    """Strategy, state workspaces, forge channels and the cross-rank agreement check."""
    from .. import sp
    from ..variants.transitions import Kind

    p.delta = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    p.zeros = torch.zeros(B, H, K, V, dtype=torch.float32, device=p.device)
    if simulated:
        if strategy not in ("auto", "forge"):
            raise PlanError(f"strategy={strategy!r}: a SimRank group runs only 'forge' (the "
                            "simulated transport)")
        from ..sp import forge

        p.strategy, p.strategy_obj = "forge", forge.FORGE
    else:
        if strategy not in sp.names():
            raise PlanError(f"strategy: expected one of {sp.names()}, got {strategy!r}")
        try:
            p.strategy_obj = sp.resolve(strategy, p.device)
        except (ValueError, RuntimeError) as err:
            raise PlanError(str(err)) from None
        p.strategy = p.strategy_obj.name
        from ..ops import checks

        # once per plan, not per run: every rank must have planned the same call
        fields = {"B": B, "T (tokens per rank)": T, "H": H, "K": K, "V": V,
                  "dtype": checks.dtype_code(dtype),
                  "strategy": sp.names().index(p.strategy) + 1,
                  "op": list(_KIND).index(p.op) + 1, "gated": int(bool(gated))}
        checks.across_ranks(p.group, p.device, fields)
    if p.strategy == "forge":
        from ..sp import forge

        # symmetric buffers now: their allocation is a collective (NVSHMEM)
        ch, bk, bv = forge._channel(forge._Where(p.group), "fwd", p.delta, Kind(p.kind))
        p.channels = {"direction": "fwd", "tile": [bk, bv], "tiles": int(ch.sig.numel()),
                      "transport": "sim" if simulated else "nvshmem"}

"""Plan once, run many times (FlashInfer style): the :class:`Plan` of one op call.

``p = plan("simple_gla", B=1, T=4096, H=32, K=128, V=128, dtype=torch.bfloat16)`` fixes, once:
shapes and dtypes, the execution strategy (fused/decoupled, from the kernels' scheduler),
the tile configs (the kernels' tables), the launch program
(:func:`forge_dist.kernels.forward_program`, run by :mod:`.executor`), the workspaces, the
kernels (cubins bound to the static dispatcher, or the JIT kernels), and
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
(:mod:`forge_dist.kernels.jit_launch`), so a plan without cubins also skips Triton's per-call path.
Single-device plans also have :meth:`Plan.run_backward`, the gradients of a run (hgrn from
the run's outputs, which are its states; the matrix-state ops from its inputs, recomputing
the chunk states as their backward kernels do), which the ops wrap in autograd.

``run`` is forward-only (no autograd) and CUDA-graph capturable on one GPU: it allocates only
its outputs (``torch.empty``, which capture serves from the graph's pool; pass ``out=`` to
reuse a buffer), never reads a device value on the host, never synchronises, and launches on
the current stream.  A plan's workspaces are reused by every call, so one plan must not run
concurrently on two streams.  Sequence-parallel plans with strategy ``forge`` are
capturable too (device-side epochs; see ``forge_dist/runtime/__init__.py``).

:func:`.planner.plan` makes plans; :mod:`.executor` runs their programs.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels
from ..sp import phases
from ..sp.base import Strategy
from ..variants import registry
from ..variants.transitions import Kind
from . import fastpath, front, sp_train
from .executor import BoundRun, Executor


class PlanError(ValueError):
    """A plan cannot be made, or a tensor does not match the plan it is run with."""


class Plan:
    """A planned op call; make one with :func:`.planner.plan`.

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
        tensors = self._checked_inputs("run", inputs)
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

    def _checked_inputs(self, what: str, inputs) -> Dict[str, Tensor]:
        """``inputs`` by name, each checked against the plan."""
        names = self.input_names
        if len(inputs) != len(names):
            raise PlanError(f"{what}: expected {len(names)} inputs ({', '.join(names)}), got "
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
        return tensors

    def run_train(self, *inputs: Tensor, initial_state: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Optional[Tensor], "sp_train.Kept"]:
        """A sequence-parallel run to be differentiated (plans made with ``train=True``):
        ``(o, final_state or None, kept)``; ``kept`` goes to :meth:`run_backward_train`.
        Arguments as :meth:`run`; called without autograd (the ops' autograd function)."""
        if not self.train:
            raise PlanError("run_train: make the plan with train=True (a group of more than "
                            "one rank)")
        tensors = self._checked_inputs("run_train", inputs)
        self._check_state_and_grad(inputs, initial_state)
        o = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        return sp_train.forward(self, tensors, initial_state, o)

    def run_backward_train(self, *tensors: Tensor, kept: "sp_train.Kept",
                           dht: Optional[Tensor] = None, need_initial_grad: bool = False
                           ) -> Tuple[Optional[Tensor], ...]:
        """Gradients of one :meth:`run_train` on this rank (every rank of the group calls
        it, in the same order as their runs: the reverse chain crosses ranks): those of the
        inputs in ``input_names`` order, then the initial state's (rank 0, else ``None``).

        Args:
            tensors: ``(*inputs, do)``: the inputs the run took and the gradient of ``o``;
                hgrn, as :meth:`run_backward`: ``(g, o, do)``, the gates the run took, its
                outputs (its states, which the backward reads; ``x`` it does not) and their
                gradient.
            kept: what the run returned for its backward.
            dht: the gradient of the returned final state (fp32), or ``None``.
        """
        hgrn = registry.get(self.op).vector_state
        names = ("g", "o", "do") if hgrn else tuple(self.input_names) + ("do",)
        if len(tensors) != len(names):
            raise PlanError(f"run_backward_train: expected {len(names)} tensors "
                            f"({', '.join(names)}), got {len(tensors)}")
        *inputs, do = tensors
        if hgrn:
            self._check("g", inputs[0], self.shapes["g"], self.dtypes["g"])
            self._check("o", inputs[1], self.out_shape, self.out_dtype)
            given = {"g": inputs[0], "h": inputs[1]}
        else:
            given = self._checked_inputs("run_backward_train", inputs)
        self._check("do", do, self.out_shape, self.out_dtype)
        if dht is not None:
            self._check("dht", dht, self.state_shape, torch.float32)
        return sp_train.backward(self, given, do, dht, kept, need_initial_grad)

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
        hgrn = registry.get(self.op).vector_state  # hgrn's outputs are its states
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
            given["dg"] = kernels.summed_gate_grad(given["dg_part"])
        grads = [given["dq"], given["dk"], given["dv"]]
        if g is not None:
            grads.append(given["dg"].to(g.dtype))
        if "beta" in self.input_names:
            grads.append(given["dbeta"].to(self.dtypes["beta"]))
        grads.append(given.get("dh0") if need_initial_grad else None)
        return tuple(grads)

    def _backward_exec(self, has_dht: bool) -> Executor:
        exe = self._bwd_execs.get(has_dht)
        if exe is None:
            if registry.get(self.op).vector_state:
                B, T, D = self.out_shape
                prog = kernels.backward_program(
                    self.op, B=B, T=T, D=D, dtype=self.out_dtype, gate_dtype=self.dtypes["g"],
                    has_h0=self.initial_state, has_dht=has_dht,
                    execution=self.execution_request)
            else:
                B, T, H, K = self.shapes["q"]
                # a sequence-parallel rank after the first starts from its incoming state
                prog = kernels.backward_program(
                    self.op, B=B, T=T, H=H, K=K, V=self.out_shape[-1], dtype=self.out_dtype,
                    gated="g" in self.shapes, has_h0=self.initial_state or self.rank > 0,
                    has_dht=has_dht,
                    scale=self.scale, interp=self._interp,
                    beta_dtype=self.dtypes.get("beta", torch.float32),
                    sms=kernels.sm_count(self.device))
            exe = self._bwd_execs[has_dht] = Executor(prog, self.device, self._dispatcher,
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
        """One rank's part: the program's launches up to its output walks (the gates' chunk
        tensors, the segment summaries), the strategy's state pass (forge: one GPU-initiated
        launch that folds the summaries and passes the state on), then the output walks,
        which take the incoming state as ``h0``.  No host synchronisation."""
        rank = self.rank
        if self.output_final_state:
            ht = torch.empty(self.ht_shape, dtype=torch.float32, device=self.device)
        else:  # nobody sees it: the plan's scratch
            ht = self._ht_scratch
        tensors["o"], tensors["ht"] = o, ht
        exe, split = self.finish_exec, self.sp_split
        exe.run_range(tensors, 0, split)
        S0 = (h0 if h0 is not None else self.zeros) if rank == 0 else self.zeros
        if S0.dim() != 4:  # hgrn's [B, D] state passes as [B, 1, D, 1] (forge_dist.sp's layout)
            S0 = S0.view(self.zeros.shape)
        # a training plan's program keeps the folded summary whatever the strategy
        plan_forward = (Strategy.plan_forward.__get__(self.strategy_obj) if self.train
                        else self.strategy_obj.plan_forward)
        with phases.STATE_PASS:
            S_in = plan_forward(Kind(self.kind), exe.workspaces, S0, self.s_in, self.group,
                                self.word, self._pass_keep, zero_start=rank == 0 and h0 is None)
        if rank > 0:
            tensors["h0"] = S_in
        elif h0 is not None:
            tensors["h0"] = h0
        exe.run_range(tensors, split, len(exe.program.launches))
        if self._specialise_pending:
            self._specialise_compiled()
        return o, (ht if self.output_final_state else None)

    def _final(self, ht):
        return ht

    def _run_torch(self, tensors, h0):
        fn = front.torch_op(self.op)
        spec = registry.get(self.op)
        kw = dict(initial_state=h0, output_final_state=self.output_final_state)
        if not spec.vector_state:
            kw["scale"] = self.scale
        return fn(*[tensors.get(n) for n in spec.inputs], **kw)  # an absent gate: None

    # -- reporting -------------------------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        """What the plan fixed: shapes, dtypes, backend, strategy, execution, launches."""
        def launches(ex):
            if ex is None:
                return []
            return [{"kernel": ln.kernel, "grid": list(ln.grid), "num_warps": ln.num_warps,
                     "num_stages": ln.num_stages, "stream": "side" if ln.stream else "main",
                     "constexprs": {k: v for k, v in ln.constexprs},
                     "path": path}
                    for ln, path in zip(ex.program.launches, ex.paths)]
        ws = {}
        for ex in (self.finish_exec, *self._bwd_execs.values()):
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
                "state_pass_before": (self.sp_split if self.size > 1 else None),
                "backward_launches": {("with dht" if k else "without dht"): launches(ex)
                                      for k, ex in self._bwd_execs.items()},
                "workspaces": ws, "channels": self.channels}

    def __repr__(self) -> str:
        d = self.describe()
        return (f"Plan({d['op']}, backend={d['backend']}, execution={d['execution']}, "
                f"world={d['world_size']}, launches={[x['kernel'] for x in d['launches']]})")

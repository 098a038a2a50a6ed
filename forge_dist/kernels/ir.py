"""Launch records: the exact kernel launches of one call, fixed ahead of time.

A *program* is a list of :class:`Launch` records (kernel, grid, runtime arguments bound to
named buffers, constexprs, warps, stages) plus the :class:`Buffer` records it needs
(inputs, outputs, workspaces, scratch).  The kernel modules build them (``forward_program``
and ``backward_program`` of each pattern module, and the one-launch builders beside each
kernel); the eager functions, :mod:`forge_dist.runtime`'s plans, the static dispatcher and
the AOT cache all run or compile those same records, so a plan can never ask for a kernel
the AOT step did not build, and a launch is written down once.

:data:`KERNELS` names every kernel a program may launch (name -> module, attribute).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

# kernel name -> (module, attribute).  Only these kernels are compiled / dispatched.
KERNELS: Dict[str, Tuple[str, str]] = {
    "walk": ("forge_dist.kernels.walker", "_walk_kernel"),
    "segment_scan": ("forge_dist.kernels.walker", "_segment_scan_kernel"),
    "gate_cumsum": ("forge_dist.kernels.walker", "_gate_cumsum_kernel"),
    "gla_gate": ("forge_dist.kernels.vector", "_gate_kernel"),
    "wy": ("forge_dist.kernels.delta", "_wy_kernel"),
    "hgrn": ("forge_dist.kernels.vector_state", "_hgrn_kernel"),
    "hgrn_scan": ("forge_dist.kernels.vector_state", "_hgrn_scan_kernel"),
    "hgrn_bwd": ("forge_dist.kernels.vector_state", "_hgrn_bwd_kernel"),
    # the matrix-state backward programs (built by the kernel modules, backward_program)
    "chunk_states": ("forge_dist.kernels.scalar_backward", "_fwd_states_kernel"),
    "chunk_states_bwd": ("forge_dist.kernels.scalar_backward", "_bwd_states_kernel"),
    "scalar_dv": ("forge_dist.kernels.scalar_backward", "_dv_kernel"),
    "scalar_dqkg": ("forge_dist.kernels.scalar_backward", "_dqkg_kernel"),
    "gla_dqkg": ("forge_dist.kernels.vector_backward", "_dqkg_kernel"),
    "gla_dqkg_exact": ("forge_dist.kernels.vector_backward", "_dqkg_exact_kernel"),
    "gla_dv": ("forge_dist.kernels.vector_backward", "_dv_kernel"),
    "delta_dstates": ("forge_dist.kernels.delta_backward", "_dstates_kernel"),
    "delta_dqk": ("forge_dist.kernels.delta_backward", "_dqk_kernel"),
    "delta_wy_bwd": ("forge_dist.kernels.delta_backward", "_wy_bwd_kernel"),
}

_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
             torch.float64: "fp64", torch.int32: "i32"}


def tl_type(dtype: torch.dtype) -> str:
    """Triton's signature name of a tensor's element type (``torch.bfloat16 -> "bf16"``)."""
    try:
        return _TL_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"no Triton element type for {dtype}") from None


def resolve_kernel(name: str):
    """The kernel object (a ``JITFunction``, or the interpreter's wrapper) called ``name``."""
    if ":" in name:  # "module:attr" for kernels outside the registry (tests, extensions)
        module, attr = name.split(":", 1)
    else:
        try:
            module, attr = KERNELS[name]
        except KeyError:
            raise KeyError(f"unknown kernel {name!r}; known: {sorted(KERNELS)}") from None
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Buffer:
    """A tensor a program reads or writes: ``role`` is input, output, workspace (allocated
    once per plan, its pointer fixed) or scratch (allocated per call, like an output, and
    dropped after it: the backward programs' chunk-state stacks grow with T)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    role: str


# Launch.stream: the caller's stream, or a second stream beside it (see Launch)
MAIN, SIDE = 0, 1


@dataclass(frozen=True)
class Launch:
    """One kernel launch.

    ``args`` are the kernel's runtime (non-constexpr) parameters in order, each
    ``(param name, kind, value)`` with kind ``"buf"`` (value: a buffer name), ``"i32"`` or
    ``"fp32"`` (value: the number).

    ``stream``: ``MAIN`` (the caller's stream) or ``SIDE``.  A side launch reads what the
    main launches before it wrote and runs after the side launches before it; the main
    launches after it neither wait for it nor read what it writes nor write what it reads,
    and the caller's stream waits for every side launch at the end of the launches run
    together (a whole program, or :meth:`~forge_dist.runtime.executor.Executor.run_range`'s
    range).  So a GPU executor
    may run it concurrently with the main launches after it (the delta rule's summary walks
    behind its WY factors, docs/design.md section 3), and running every launch in order on
    one stream, as the eager and CPU paths do, gives the same result.
    """

    kernel: str
    grid: Tuple[int, int, int]
    args: Tuple[Tuple[str, str, Any], ...]
    constexprs: Tuple[Tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    stream: int = MAIN

    def spec(self, buffers: Dict[str, Buffer]) -> "KernelSpec":
        """The compile-time identity of this launch (argument types, constexprs, options);
        a jitted function passed as a constexpr (a fused prologue) is named by its name,
        which :mod:`forge_dist.dsl.codegen` derives from its source."""
        sig = []
        for name, kind, value in self.args:
            sig.append((name, "*" + tl_type(buffers[value].dtype) if kind == "buf" else kind))
        const = tuple((n, f"fn:{_function_name(v)}" if callable(v) else v)
                      for n, v in self.constexprs)
        return KernelSpec(self.kernel, tuple(sig), const, self.num_warps, self.num_stages)


def _function_name(fn) -> str:
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", None)
    return name or repr(fn)


@dataclass(frozen=True)
class KernelSpec:
    """What one cubin is compiled for; ``key`` names it in the AOT cache.

    ``signature`` lists the runtime parameters ``(name, type)`` in order (``"*bf16"``,
    ``"i32"``, ``"fp32"`` ...); every pointer is compiled assuming 16-byte alignment (what
    Triton's JIT assumes for such pointers too), so the dispatcher checks alignment.
    """

    kernel: str
    signature: Tuple[Tuple[str, str], ...]
    constexprs: Tuple[Tuple[str, Any], ...]
    num_warps: int
    num_stages: int

    def to_json(self) -> Dict[str, Any]:
        return {"kernel": self.kernel, "signature": [list(x) for x in self.signature],
                "constexprs": [list(x) for x in self.constexprs],
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_json(d: Dict[str, Any]) -> "KernelSpec":
        return KernelSpec(d["kernel"], tuple(tuple(x) for x in d["signature"]),
                          tuple(tuple(x) for x in d["constexprs"]), int(d["num_warps"]),
                          int(d["num_stages"]))

    @property
    def key(self) -> str:
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class Program:
    """Launches in order and the buffers they use."""

    launches: List[Launch]
    buffers: Dict[str, Buffer]
    execution: str
    notes: List[str] = field(default_factory=list)
    _lifetimes: Optional[Tuple[List[List[str]], List[List[str]]]] = field(
        default=None, repr=False, compare=False)

    def specs(self) -> List[KernelSpec]:
        return [ln.spec(self.buffers) for ln in self.launches]

    def parts(self, groups: List[List[int]]) -> List["Program"]:
        """This program cut into programs run one after another, ``groups`` the launch
        indices of each (every launch once; a launch after one it reads from).  A scratch
        buffer used by several parts becomes an output of the first and an input of the
        rest, which the caller keeps between them; so does a workspace (hgrn's segment
        gradients, which a later part reads), else each part's executor would own its own.
        A sequence-parallel backward runs the reverse chain between two parts."""
        if sorted(i for g in groups for i in g) != list(range(len(self.launches))):
            raise ValueError(f"parts: expected every launch index once, got {groups}")
        used = [{v for g_i in g for _, kind, v in self.launches[g_i].args if kind == "buf"}
                for g in groups]
        out = []
        for n, g in enumerate(groups):
            bufs = {}
            for name in sorted(used[n]):
                buf = self.buffers[name]
                shared = buf.role in ("scratch", "workspace")
                if shared and any(name in u for u in used[:n]):
                    buf = Buffer(buf.shape, buf.dtype, "input")
                elif shared and any(name in u for u in used[n + 1:]):
                    buf = Buffer(buf.shape, buf.dtype, "output")
                bufs[name] = buf
            out.append(Program([self.launches[i] for i in g], bufs, self.execution,
                               list(self.notes)))
        return out

    def lifetimes(self) -> Tuple[List[List[str]], List[List[str]]]:
        """``(allocate_at, free_at)``: per launch, the output and scratch buffers first
        used by it (allocated just before it) and the scratch buffers last used by it
        (dropped right after): a backward program's peak memory is then that of its
        kernels' own function, which freed its chunk states before the last launches.
        Computed once: a program is not changed after it is built."""
        if self._lifetimes is None:
            self._lifetimes = self._schedule()
        return self._lifetimes

    def _schedule(self) -> Tuple[List[List[str]], List[List[str]]]:
        first: Dict[str, int] = {}
        last: Dict[str, int] = {}
        for i, ln in enumerate(self.launches):
            for _, kind, value in ln.args:
                if kind == "buf" and self.buffers[value].role in ("output", "scratch"):
                    first.setdefault(value, i)
                    last[value] = i
        allocate_at: List[List[str]] = [[] for _ in self.launches]
        free_at: List[List[str]] = [[] for _ in self.launches]
        for name, i in first.items():
            allocate_at[i].append(name)
        for name, i in last.items():
            if self.buffers[name].role == "scratch":
                free_at[i].append(name)
        return allocate_at, free_at

    def run_scoped(self, tensors: Dict[str, torch.Tensor], device,
                   launch: Callable[[int, Dict[str, torch.Tensor]], None]
                   ) -> Dict[str, torch.Tensor]:
        """``launch(i, tensors)`` for every launch in order, with each output and scratch
        buffer that ``tensors`` lacks allocated on ``device`` just before its first launch
        and each scratch buffer dropped right after its last (:meth:`lifetimes`); returns
        ``tensors`` with the outputs."""
        allocate_at, free_at = self.lifetimes()
        for i, (new, done) in enumerate(zip(allocate_at, free_at)):
            for name in new:
                if name not in tensors:
                    buf = self.buffers[name]
                    tensors[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            launch(i, tensors)
            for name in done:
                del tensors[name]
        return tensors

    def execute(self, tensors: Dict[str, torch.Tensor], device) -> Dict[str, torch.Tensor]:
        """Launch every kernel through Triton's JIT (how the kernel modules' own functions
        run a program they built), buffers as in :meth:`run_scoped`.  The kernels are looked
        up at each call (tests wrap them)."""
        def launch(i, tensors):
            run_launch(self.launches[i], tensors)
        return self.run_scoped(tensors, device, launch)


def run_launch(ln: Launch, tensors: Dict[str, torch.Tensor], kernel=None) -> None:
    """Launch ``ln`` through Triton's JIT with its buffers taken from ``tensors`` (by buffer
    name); ``kernel``: the kernel object to call (default: the registry's, looked up now)."""
    call = {name: tensors[value] if kind == "buf" else value for name, kind, value in ln.args}
    kernel = resolve_kernel(ln.kernel) if kernel is None else kernel
    kernel[ln.grid](**call, **dict(ln.constexprs), num_warps=ln.num_warps,
                    num_stages=ln.num_stages)


def state_buffers(bufs: Dict[str, Buffer], shape: Tuple[int, ...], *, has_h0: bool,
                  has_dht: bool) -> None:
    """Add a backward program's optional state buffers to ``bufs``, fp32 ``shape``: the
    incoming state ``h0`` (input) and its gradient ``dh0`` (output) with ``has_h0``, the
    final state's gradient ``dht`` (input) with ``has_dht``."""
    if has_h0:
        bufs["h0"] = Buffer(shape, torch.float32, "input")
        bufs["dh0"] = Buffer(shape, torch.float32, "output")
    if has_dht:
        bufs["dht"] = Buffer(shape, torch.float32, "input")


def buffer_args(bufs: Dict[str, Buffer], placeholder: str):
    """``name -> ("buf", name)`` for a launch's pointer argument, or ``("buf",
    placeholder)`` where ``bufs`` has no such buffer (an absent optional tensor, which the
    kernel's constexpr flags keep it from reading)."""
    return lambda name, dummy=placeholder: ("buf", name if name in bufs else dummy)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def grid_size(grid) -> int:
    """Programs in a launch grid."""
    return math.prod(grid)

"""Launch programs: the exact kernel launches of one call, fixed ahead of time.

A *program* is a list of :class:`Launch` records (kernel, grid, runtime arguments bound to
named buffers, constexprs, warps, stages) plus the buffers it needs (inputs, outputs,
workspaces).  It is what :mod:`forge_dist.runtime.plan` runs on every call, what the static
dispatcher launches from cubins, and what :mod:`forge_dist.runtime.aot` enumerates to know
which kernels to compile: one source for all three, so a plan can never ask for a kernel
the AOT step did not build.

The forward builders mirror the launch code of :mod:`forge_dist.kernels` (``walk`` with its
fused and segmented schedules, ``gate_chunks``, ``wy``, ``hgrn_forward``) and take their tile
configs from the kernels' own tables (``fused_config`` & co.) and the scheduler.  The tests
check every program against :func:`forge_dist.kernels.forward`, so a drift shows up there.
The matrix-state backward programs are built by the kernel modules themselves
(``backward_program`` in ``kernels.scalar_backward``, ``vector_backward``,
``delta_backward``), whose backward functions run them through :meth:`Program.execute`:
there the program is the launch code.
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
    "walk": ("forge_dist.kernels._common", "_walk_kernel"),
    "segment_scan": ("forge_dist.kernels._common", "_segment_scan_kernel"),
    "gate_cumsum": ("forge_dist.kernels._common", "_gate_cumsum_kernel"),
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

MATRIX_VARIANTS = ("linear_attn", "simple_gla", "gla", "gated_delta_rule")
VARIANTS = MATRIX_VARIANTS + ("hgrn",)

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


@dataclass(frozen=True)
class Launch:
    """One kernel launch.

    ``args`` are the kernel's runtime (non-constexpr) parameters in order, each
    ``(param name, kind, value)`` with kind ``"buf"`` (value: a buffer name), ``"i32"`` or
    ``"fp32"`` (value: the number).
    """

    kernel: str
    grid: Tuple[int, int, int]
    args: Tuple[Tuple[str, str, Any], ...]
    constexprs: Tuple[Tuple[str, Any], ...]
    num_warps: int
    num_stages: int

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


def _map_consts(maps: Optional[Dict[str, Any]], names: str) -> Tuple[Tuple[str, Any], ...]:
    """Constexprs ``Q_MAP`` ... for the inputs in ``names`` with a fused prologue, by the
    kernels' own rule (``kernels._common.map_flags``)."""
    from ..kernels._common import map_flags

    return tuple(map_flags(maps, names).items())


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
            ln = self.launches[i]
            call = {name: tensors[value] if kind == "buf" else value
                    for name, kind, value in ln.args}
            resolve_kernel(ln.kernel)[ln.grid](**call, **dict(ln.constexprs),
                                               num_warps=ln.num_warps,
                                               num_stages=ln.num_stages)
        return self.run_scoped(tensors, device, launch)


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prec(dtype: torch.dtype, interp: bool) -> str:
    # the kernels' rule (kernels._common.dot_precision): IEEE under the interpreter, else 3xTF32
    return "ieee" if interp else "tf32x3"


def _walk_launch(*, q, k, v, g, w, h0, o, ht, gt, B, T, H, K, V, gate, scale, cfg, prec,
                 seg, n, store_ht=True, a=None, s_in=None, scan_in=False, maps=None,
                 raw_gates=False, hc=None, vn=None) -> Launch:
    """One walker launch over ``n`` segments of ``seg`` tokens (``kernels._common.walk``);
    ``scan_in``: the output walks that fold the segment scan in (``gt`` is then read);
    ``hc, vn``: the buffers a backward pass keeps, every chunk's start state and the values
    the state update used (``STORE_CHUNKS``)."""
    BK = _pow2(K)
    BV = min(cfg["BV"], _pow2(V))
    args = (("q", "buf", q or k), ("k", "buf", k), ("v", "buf", v or k), ("g", "buf", g or k),
            ("w", "buf", w or k), ("h0", "buf", h0 or ht), ("o", "buf", o or ht),
            ("ht", "buf", ht), ("gt", "buf", gt or ht), ("T", "i32", T), ("SEG", "i32", seg),
            ("scale", "fp32", float(scale)))
    const = (("H", H), ("K", K), ("V", V), ("BT", cfg["BT"]), ("BK", BK), ("BV", BV),
             ("GATE", gate), ("HAS_V", v is not None), ("HAS_W", w is not None),
             ("HAS_H0", h0 is not None), ("STORE_O", q is not None), ("STORE_HT", store_ht),
             ("PREC", prec), ("HAS_A", a is not None))
    # ``a`` is a pointer when given, else a None constexpr (as Triton's JIT treats None)
    if a is not None:
        args = args + (("a", "buf", a),)
    else:
        const = const + (("a", None),)
    const = const + (("STORE_GT", gt is not None and not scan_in), ("HAS_SIN", s_in is not None))
    if s_in is not None:
        args = args + (("s_in", "buf", s_in),)
    else:
        const = const + (("s_in", None),)
    # the sequence-parallel extra (the incoming state folded through cg) stays off here
    if hc is not None:
        args = args + (("hc", "buf", hc), ("vn", "buf", vn))
        const = const + (("cg", None), ("HT_LAST", scan_in), ("STORE_CHUNKS", True))
    else:
        const = const + (("cg", None), ("HT_LAST", scan_in), ("STORE_CHUNKS", False),
                         ("hc", None), ("vn", None))
    const = const + (("SCAN_IN", scan_in),)
    const = const + _map_consts(maps, ("q" if q else "") + "k" + ("v" if v else ""))
    if raw_gates:  # set only when on, as the kernels' launcher does (same compiled kernel)
        const = const + (("G_RAW", True),)
    return Launch("walk", (_cdiv(V, BV), B * H, n), args, const, cfg["num_warps"],
                  cfg["num_stages"])


def _gate_cumsum(buffers, *, B: int, T: int, H: int, BT: int, maps=None,
                 role: str = "workspace") -> Launch:
    """The scalar gates' chunk-local cumulative sums for the walker
    (``kernels._common.chunk_gate_cumsum``): ``g [B, T, H]`` -> ``g_cum [B, H, T]`` (a
    buffer of ``role``)."""
    from ..kernels._common import GATE_CUMSUM_WARPS

    buffers["g_cum"] = Buffer((B, H, T), torch.float32, role)
    return Launch("gate_cumsum", (_cdiv(T, BT), B, 1),
                  (("g", "buf", "g"), ("gc", "buf", "g_cum"), ("T", "i32", T)),
                  (("H", H), ("BT", BT), ("BH", _pow2(H))) + _map_consts(maps, "g"),
                  GATE_CUMSUM_WARPS, 1)


def _walk(buffers, *, q, k, v, g, w, h0, o, ht, B, T, H, K, V, gate, scale, cfg, prec,
          a=None, n_seg: int = 1, maps=None, raw_gates: bool = False) -> List[Launch]:
    """The walker's launches, exactly as ``kernels._common.walk`` makes them: one fused
    launch, or (``n_seg > 1``) segment summaries, the segment scan and segment outputs."""
    from ..kernels._common import segment_length

    BT, BK, BV = cfg["BT"], _pow2(K), min(cfg["BV"], _pow2(V))
    seg = segment_length(T, BT, n_seg)
    n_seg = max(1, _cdiv(T, seg))
    common = dict(k=k, v=v, g=g, w=w, B=B, T=T, H=H, K=K, V=V, gate=gate, scale=scale,
                  cfg=cfg, prec=prec, seg=seg, maps=maps, raw_gates=raw_gates)
    if n_seg == 1:
        return [_walk_launch(q=q, h0=h0, o=o, ht=ht, gt=None, n=1, a=a, **common)]
    buffers["hs"] = Buffer((n_seg, B, H, K, V), torch.float32, "workspace")
    gt = None
    if gate:
        gt = "gt"
        buffers["gt"] = Buffer((n_seg, B, H, K), torch.float32, "workspace")
    launches = [_walk_launch(q=None, h0=None, o=None, ht="hs", gt=gt, n=n_seg, **common)]
    if q is not None:  # the output walks fold the segment scan in
        launches.append(_walk_launch(q=q, h0="hs", o=o, ht=ht, gt=gt, n=n_seg, a=a, s_in=h0,
                                     scan_in=True, **common))
        return launches
    launches.append(Launch("segment_scan", (_cdiv(V, BV), B * H, 1),
                           (("hs", "buf", "hs"), ("gt", "buf", gt or "hs"),
                            ("h0", "buf", h0 or ht), ("ht", "buf", ht), ("NSEG", "i32", n_seg)),
                           (("K", K), ("V", V), ("BK", BK), ("BV", BV), ("GATED", gate != 0),
                            ("HAS_H0", h0 is not None), ("STORE_CG", False), ("cg", None)),
                           cfg["num_warps"], cfg["num_stages"]))
    return launches


def matrix_program(variant: str, *, B: int, T: int, H: int, K: int, V: int,
                   dtype: torch.dtype, gated: bool, has_h0: bool, store_o: bool = True,
                   scale: Optional[float] = None, execution: Optional[str] = None,
                   interp: bool = False, tiles: Optional[dict] = None,
                   gate_dtype: torch.dtype = torch.float32,
                   beta_dtype: Optional[torch.dtype] = None,
                   maps: Optional[Dict[str, Any]] = None) -> Program:
    """Program of one matrix-state segment forward (or, ``store_o=False``, its summary).

    Buffers: inputs ``q, k, v`` (``dtype``), ``g`` (``gate_dtype``, ``[B, T, H]`` or
    ``[B, T, H, K]`` for gla), ``beta`` (gated_delta_rule, ``beta_dtype``, default
    ``gate_dtype``), ``h0`` (fp32 ``[B, H, K, V]``); outputs ``o`` (``dtype``) and ``ht``
    (fp32); workspaces by pattern.  ``execution`` forces fused or
    decoupled (not the delta rule); ``None`` asks the scheduler (Algorithm 1), as the
    kernels do.  ``tiles`` overrides entries of the kernels' tile config.  ``maps``: fused
    prologues by input name (jitted maps of :mod:`forge_dist.dsl.codegen`; not for
    gated_delta_rule), applied as the kernels load.
    """
    from ..kernels import scheduler
    from ..kernels._common import sum_gates_in_walk

    if variant not in MATRIX_VARIANTS:
        raise ValueError(f"variant: expected one of {MATRIX_VARIANTS}, got {variant!r}")
    scale = K ** -0.5 if scale is None else float(scale)
    prec = _prec(dtype, interp)
    bufs: Dict[str, Buffer] = {
        "q": Buffer((B, T, H, K), dtype, "input"), "k": Buffer((B, T, H, K), dtype, "input"),
        "v": Buffer((B, T, H, V), dtype, "input"),
        "ht": Buffer((B, H, K, V), torch.float32, "output")}
    if store_o:
        bufs["o"] = Buffer((B, T, H, V), dtype, "output")
    if has_h0:
        bufs["h0"] = Buffer((B, H, K, V), torch.float32, "input")
    g = "g" if gated else None
    if variant == "linear_attn" and gated:
        raise ValueError("linear_attn takes no gate")
    if variant == "gla" and not gated:
        raise ValueError("gla needs its gate g [B, T, H, K]")
    if gated:
        bufs["g"] = Buffer((B, T, H, K) if variant == "gla" else (B, T, H), gate_dtype, "input")
    q = "q" if store_o else None
    o = "o" if store_o else None
    h0 = "h0" if has_h0 else None
    notes: List[str] = []

    if variant in ("linear_attn", "simple_gla", "gla"):
        from ..kernels import scalar, vector

        kern = vector if variant == "gla" else scalar
        cfg = dict(kern.fused_config(K, V), **(tiles or {}))
        sched = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], _pow2(V)),
                                   elem_size=torch.empty((), dtype=dtype).element_size(),
                                   gate_elems=K if variant == "gla" else 0, request=execution)
        notes.append(f"execution {sched.strategy} ({sched.n_seg} segments): {sched.reason}")
        launches: List[Launch] = []
        a = None
        k_walk, q_walk, g_walk = "k", q, g
        if variant == "gla":  # the gated chunk tensors first (kernels.vector.gate_chunks)
            BT = cfg["BT"]
            bufs["kd"] = Buffer((B, T, H, K), dtype, "workspace")
            bufs["gc"] = Buffer((B, _cdiv(T, BT), H, K), torch.float32, "workspace")
            if store_o:
                bufs["qg"] = Buffer((B, T, H, K), dtype, "workspace")
                bufs["a"] = Buffer((B, T, H, BT), dtype, "workspace")
                a = "a"
            launches.append(Launch(
                "gla_gate", (_cdiv(T, BT), B * H, 1),
                (("q", "buf", "q"), ("k", "buf", "k"), ("g", "buf", "g"),
                 ("qg", "buf", "qg" if store_o else "kd"), ("kd", "buf", "kd"),
                 ("a", "buf", a or "kd"), ("gc", "buf", "gc"), ("T", "i32", T),
                 ("span_limit", "fp32", vector.span_max(dtype))),
                (("H", H), ("K", K), ("BT", BT), ("BK", _pow2(K)),
                 ("BKS", min(vector.GATE_CONFIG["BKS"], _pow2(K))),
                 ("BC", min(vector.GATE_CONFIG["BC"], BT)), ("PREC", prec),
                 ("STORE_KD", True), ("STORE_QA", store_o)) + _map_consts(maps, "qkg"),
                vector.GATE_CONFIG["num_warps"], vector.GATE_CONFIG["num_stages"]))
            k_walk, q_walk, g_walk = "kd", ("qg" if store_o else None), "gc"
            walk_maps = {"v": maps["v"]} if maps and maps.get("v") else None
        else:
            walk_maps = maps
        raw_gates = False
        if gated and variant == "simple_gla":
            # kernels._common.walk's rule: short inputs sum the gates in the walks (one
            # launch fewer), long ones read a gate sum made before them
            raw_gates = sum_gates_in_walk(B, T, (maps or {}).get("g"))
            if not raw_gates:
                launches.append(_gate_cumsum(bufs, B=B, T=T, H=H, BT=cfg["BT"], maps=maps))
                g_walk = "g_cum"
        gate = 2 if variant == "gla" else (1 if gated else 0)
        launches += _walk(bufs, q=q_walk, k=k_walk, v="v", g=g_walk, w=None, h0=h0, o=o, ht="ht", B=B, T=T,
                          H=H, K=K, V=V, gate=gate, scale=scale, cfg=cfg, prec=prec, a=a,
                          n_seg=sched.n_seg, maps=walk_maps, raw_gates=raw_gates)
        return Program(launches, bufs, sched.strategy, notes)

    if execution not in (None, "auto", scheduler.FUSED):
        raise ValueError(f"execution={execution!r}: {variant} has only the fused kernels")
    if maps:
        raise ValueError("maps: the gated_delta_rule kernels take no fused prologues")
    # gated_delta_rule
    from ..kernels import delta

    if not store_o:
        raise ValueError("gated_delta_rule: the summary program (with its dense transition) "
                         "is not built here; use forge_dist.ops for sequence parallelism")
    cfg = dict(delta.fused_config(K, V, dtype), **(tiles or {}))
    bufs["beta"] = Buffer((B, T, H), beta_dtype or gate_dtype, "input")
    low = dtype in (torch.float16, torch.bfloat16)
    wy_prec = "tf32" if low and prec != "ieee" else prec
    BT = cfg["BT"]
    if BT != delta.WY_BT:
        raise ValueError(f"gated_delta_rule: the WY factors work on chunks of {delta.WY_BT} "
                         f"tokens, got BT={BT}")
    bufs["w"] = Buffer((B, T, H, K), dtype, "workspace")
    bufs["u"] = Buffer((B, T, H, V), dtype, "workspace")
    bufs["xs"] = Buffer((B, T, H, BT), delta.wy_x_dtype(dtype), "workspace")
    bufs["a"] = Buffer((B, T, H, BT), dtype, "workspace")
    wy_args = (("k", "buf", "k"), ("v", "buf", "v"), ("g", "buf", g or "beta"),
               ("beta", "buf", "beta"), ("w", "buf", "w"), ("u", "buf", "u"),
               ("xs", "buf", "xs"), ("T", "i32", T))
    a_args = (("q", "buf", "q"), ("a", "buf", "a"))  # the launch forming the walk's attention
    wys = [Launch("wy", grid, wy_args + (a_args if const["STORE_A"] else ()),
                  tuple(const.items()), nw, ns)  # kernels.delta.wy
           for grid, const, nw, ns in delta.wy_launches(B, T, H, K, V, dtype=dtype,
                                                          gated=gated, prec=wy_prec,
                                                          store_a=True)]
    # the gate sum stays a launch of its own for the delta rule (kernels.delta: _finish_fwd)
    cums = [_gate_cumsum(bufs, B=B, T=T, H=H, BT=BT)] if gated else []
    walks = _walk(bufs, q="q", k="k", v="u", g="g_cum" if gated else None, w="w", h0=h0,
                  o="o", ht="ht", B=B, T=T, H=H, K=K, V=V, gate=1 if gated else 0,
                  scale=scale, cfg=cfg, prec=prec, a="a")
    return Program(wys + cums + walks, bufs, scheduler.FUSED, notes)


def matrix_backward_program(variant: str, *, B: int, T: int, H: int, K: int, V: int,
                            dtype: torch.dtype, gated: bool, has_h0: bool, has_dht: bool,
                            scale: Optional[float] = None, interp: bool = False,
                            beta_dtype: torch.dtype = torch.float32, sms: int = 132) -> Program:
    """Program of one matrix-state backward on one device: the launches of the pattern's own
    backward function (``kernels.scalar_backward``, ``vector_backward``, ``delta_backward``,
    which build it), with the plan's precision rule and ``sms`` (the device's SM count, which
    sizes the walk tiles).

    Buffers (the kernels' names): inputs ``q, k, v, do`` and, by variant, ``g`` (fp32),
    ``beta`` (``beta_dtype``), ``h0``, ``dht``; outputs ``dq, dk, dv``, ``dg`` (gla,
    gated_delta_rule) or ``dg_part`` (``[NK, B, T, H]``, simple_gla: the K tiles' shares),
    ``dbeta`` (gated_delta_rule), ``dh0`` (``has_h0``); the rest per-call scratch.
    """
    from ..kernels import delta_backward, scalar_backward, vector_backward

    if variant not in MATRIX_VARIANTS:
        raise ValueError(f"variant: expected one of {MATRIX_VARIANTS}, got {variant!r}")
    scale = K ** -0.5 if scale is None else float(scale)
    common = dict(dtype=dtype, has_h0=has_h0, has_dht=has_dht, scale=scale,
                  prec=_prec(dtype, interp))
    if variant in ("linear_attn", "simple_gla"):
        return scalar_backward.backward_program(B, T, H, K, V, gated=gated, sms=sms, **common)
    if variant == "gla":
        return vector_backward.backward_program(B, T, H, K, V, sms=sms, **common)
    return delta_backward.backward_program(B, T, H, K, V, gated=gated, beta_dtype=beta_dtype,
                                           **common)


def hgrn_program(*, B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool,
                 store_o: bool = True, tiles: Optional[dict] = None,
                 gate_dtype: Optional[torch.dtype] = None,
                 execution: Optional[str] = None,
                 maps: Optional[Dict[str, Any]] = None) -> Program:
    """Program of one hgrn segment: inputs ``x [B, T, D]``, ``g [B, T, D]`` (``gate_dtype``,
    default ``dtype``), ``h0 [B, D]`` fp32; outputs ``o [B, T, D]`` and ``ht [B, D]`` fp32.
    ``maps``: fused prologues of ``x`` and ``g`` (jitted maps)."""
    from ..kernels import vector_state

    cfg = dict(vector_state.FUSED_CONFIG, **(tiles or {}))
    bufs = {"x": Buffer((B, T, D), dtype, "input"),
            "g": Buffer((B, T, D), gate_dtype or dtype, "input"),
            "ht": Buffer((B, D), torch.float32, "output")}
    if store_o:
        bufs["o"] = Buffer((B, T, D), dtype, "output")
    if has_h0:
        bufs["h0"] = Buffer((B, D), torch.float32, "input")
    from ..kernels import scheduler
    from ..kernels._common import segment_length

    sched = scheduler.schedule_vector_state(B, T, D, cfg["BT"], cfg["BD"],
                                            elem_size=torch.empty((), dtype=dtype).element_size(),
                                            request=execution)
    seg = segment_length(T, cfg["BT"], sched.n_seg)
    n_seg = max(1, _cdiv(T, seg))
    grid = (_cdiv(D, cfg["BD"]), B, n_seg)
    const = (("D", D), ("BT", cfg["BT"]), ("BD", cfg["BD"]))
    nw, ns = cfg["num_warps"], cfg["num_stages"]
    fused = _map_consts(maps, "xg")

    def walk(h0, o, ht, gt, store_o):
        return Launch("hgrn", grid,
                      (("x", "buf", "x"), ("g", "buf", "g"), ("h0", "buf", h0 or ht),
                       ("o", "buf", o or ht), ("ht", "buf", ht), ("gt", "buf", gt or ht),
                       ("T", "i32", T), ("SEG", "i32", seg)),
                      const + (("HAS_H0", h0 is not None), ("STORE_O", store_o),
                               ("STORE_GT", gt is not None), ("HAS_SIN", False),
                               ("s_in", None), ("cg", None), ("HT_LAST", False)) + fused,
                      nw, ns)

    notes = [f"execution {sched.strategy} ({n_seg} segments): {sched.reason}"]
    h0 = "h0" if has_h0 else None
    if n_seg == 1:
        return Program([walk(h0, "o" if store_o else None, "ht", None, store_o)], bufs,
                       scheduler.FUSED, notes)
    bufs["hs"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["gt"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    launches = [walk(None, None, "hs", "gt", False),
                Launch("hgrn_scan", (grid[0], B, 1),
                       (("hs", "buf", "hs"), ("gt", "buf", "gt"), ("h0", "buf", h0 or "ht"),
                        ("ht", "buf", "ht"), ("NSEG", "i32", n_seg)),
                       (("D", D), ("BD", cfg["BD"]), ("HAS_H0", has_h0), ("STORE_CG", False),
                        ("cg", None), ("REVERSE", False)), nw, 3)]
    if store_o:
        launches.append(walk("hs", "o", "hs", None, True))
    return Program(launches, bufs, scheduler.DECOUPLED, notes)


def hgrn_backward_program(*, B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool,
                          has_dht: bool, gate_dtype: Optional[torch.dtype] = None,
                          execution: Optional[str] = None) -> Program:
    """Program of one hgrn backward from the forward's kept outputs
    (``kernels.vector_state.hgrn_backward`` with ``h=o``).

    Inputs ``g [B, T, D]`` (``gate_dtype``, default ``dtype``), ``do`` and ``h`` (the
    forward's outputs) ``[B, T, D]`` (``dtype``), ``h0 [B, D]`` fp32 (``has_h0``), ``dht
    [B, D]`` fp32 (``has_dht``); outputs ``dx`` (``dtype``) and ``dg`` (``gate_dtype``)
    ``[B, T, D]``; workspace ``cout [n_seg, B, D]`` fp32, whose row 0 is then ``dS_in``.
    DECOUPLED as the kernels: each segment's outgoing gradient from a zero start, the
    segment scan right to left (in place), then every segment's walk from its incoming
    gradient, again in place (a program reads its slot before it writes it).
    """
    from ..kernels import scheduler, vector_state
    from ..kernels._common import segment_length

    cfg = vector_state.BWD_CONFIG
    gdt = gate_dtype or dtype
    bufs = {"g": Buffer((B, T, D), gdt, "input"), "do": Buffer((B, T, D), dtype, "input"),
            "h": Buffer((B, T, D), dtype, "input"),
            "dx": Buffer((B, T, D), dtype, "output"), "dg": Buffer((B, T, D), gdt, "output")}
    if has_h0:
        bufs["h0"] = Buffer((B, D), torch.float32, "input")
    if has_dht:
        bufs["dht"] = Buffer((B, D), torch.float32, "input")
    sched = scheduler.schedule_vector_state(
        B, T, D, cfg["BT"], cfg["BD"], elem_size=torch.empty((), dtype=dtype).element_size(),
        request=execution, resident_per_sm=scheduler.VECTOR_STATE_BWD_RESIDENT_PER_SM)
    seg = segment_length(T, cfg["BT"], sched.n_seg)
    n_seg = max(1, _cdiv(T, seg))
    bufs["cout"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    bufs["gout"] = Buffer((n_seg, B, D), torch.float32, "workspace")
    grid = (_cdiv(D, cfg["BD"]), B, n_seg)
    nw, ns = cfg["num_warps"], cfg["num_stages"]

    def walk(grads: bool, cin: Optional[str]) -> Launch:
        return Launch("hgrn_bwd", grid,
                      (("g", "buf", "g"), ("do", "buf", "do"), ("h", "buf", "h"),
                       ("h0", "buf", "h0" if has_h0 else "cout"), ("cin", "buf", cin or "cout"),
                       ("dx", "buf", "dx"), ("dg", "buf", "dg"), ("cout", "buf", "cout"),
                       ("gout", "buf", "gout"), ("T", "i32", T), ("SEG", "i32", seg)),
                      (("D", D), ("BT", cfg["BT"]), ("BD", cfg["BD"]), ("HAS_DO", True),
                       ("HAS_H0", has_h0 and grads), ("HAS_CIN", cin is not None),
                       ("GRADS", grads)), nw, ns)

    notes = [f"backward execution {sched.strategy} ({n_seg} segments): {sched.reason}"]
    if n_seg == 1:
        return Program([walk(True, "dht" if has_dht else None)], bufs, scheduler.FUSED, notes)
    scan = Launch("hgrn_scan", (grid[0], B, 1),
                  (("hs", "buf", "cout"), ("gt", "buf", "gout"),
                   ("h0", "buf", "dht" if has_dht else "gout"), ("ht", "buf", "gout"),
                   ("NSEG", "i32", n_seg)),
                  (("D", D), ("BD", cfg["BD"]), ("HAS_H0", has_dht), ("STORE_CG", False),
                   ("cg", None), ("REVERSE", True)), nw, 3)
    return Program([walk(False, None), scan, walk(True, "cout")], bufs, scheduler.DECOUPLED,
                   notes)


def grid_size(grid) -> int:
    return math.prod(grid)

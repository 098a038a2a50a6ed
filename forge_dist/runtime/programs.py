"""Launch programs: the exact kernel launches of one forward call, fixed ahead of time.

A *program* is a list of :class:`Launch` records (kernel, grid, runtime arguments bound to
named buffers, constexprs, warps, stages) plus the buffers it needs (inputs, outputs,
workspaces).  It is what :mod:`forge_dist.runtime.plan` runs on every call, what the static
dispatcher launches from cubins, and what :mod:`forge_dist.runtime.aot` enumerates to know
which kernels to compile: one source for all three, so a plan can never ask for a kernel
the AOT step did not build.

The builders mirror the launch code of :mod:`forge_dist.kernels` (``walk``,
``decoupled_forward``, ``intra_attention``, ``wy``, ``hgrn_forward``) and take their tile
configs from the kernels' own tables (``fused_config`` & co.) and the scheduler.  The tests
check every program against :func:`forge_dist.kernels.forward`, so a drift shows up there.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

# kernel name -> (module, attribute).  Only these kernels are compiled / dispatched.
KERNELS: Dict[str, Tuple[str, str]] = {
    "walk": ("forge_dist.kernels._common", "_walk_kernel"),
    "chunk_state": ("forge_dist.kernels.scalar", "_chunk_state_kernel"),
    "chunk_scan": ("forge_dist.kernels.scalar", "_chunk_scan_kernel"),
    "chunk_output": ("forge_dist.kernels.scalar", "_chunk_output_kernel"),
    "gla_intra": ("forge_dist.kernels.vector", "_intra_kernel"),
    "wy": ("forge_dist.kernels.delta", "_wy_kernel"),
    "hgrn": ("forge_dist.kernels.vector_state", "_hgrn_kernel"),
}

MATRIX_VARIANTS = ("linear_attn", "simple_gla", "gla", "gated_delta_rule")
VARIANTS = MATRIX_VARIANTS + ("hgrn",)

_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
             torch.float64: "fp64"}


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
    """A tensor a program reads or writes: ``role`` is input, output or workspace."""

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
        """The compile-time identity of this launch (argument types, constexprs, options)."""
        sig = []
        for name, kind, value in self.args:
            sig.append((name, "*" + tl_type(buffers[value].dtype) if kind == "buf" else kind))
        return KernelSpec(self.kernel, tuple(sig), self.constexprs, self.num_warps,
                          self.num_stages)


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

    def specs(self) -> List[KernelSpec]:
        return [ln.spec(self.buffers) for ln in self.launches]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prec(dtype: torch.dtype, interp: bool) -> str:
    # the kernels' rule (kernels._common.dot_precision): IEEE under the interpreter, else 3xTF32
    return "ieee" if interp else "tf32x3"


def _walk(buffers, *, q, k, v, g, w, h0, o, ht, B, T, H, K, V, gate, scale, cfg, prec,
          a=None) -> Launch:
    """The fused walker, exactly as ``kernels._common.walk`` launches it."""
    BK = _pow2(K)
    BV = min(cfg["BV"], _pow2(V))
    args = (("q", "buf", q or k), ("k", "buf", k), ("v", "buf", v or k), ("g", "buf", g or k),
            ("w", "buf", w or k), ("h0", "buf", h0 or ht), ("o", "buf", o or ht),
            ("ht", "buf", ht), ("T", "i32", T), ("scale", "fp32", float(scale)))
    const = (("H", H), ("K", K), ("V", V), ("BT", cfg["BT"]), ("BK", BK), ("BV", BV),
             ("GATE", gate), ("HAS_V", v is not None), ("HAS_W", w is not None),
             ("HAS_H0", h0 is not None), ("STORE_O", q is not None), ("STORE_HT", True),
             ("PREC", prec), ("HAS_A", a is not None))
    # ``a`` is a pointer when given, else a None constexpr (as Triton's JIT treats None)
    if a is not None:
        args = args + (("a", "buf", a),)
    else:
        const = const + (("a", None),)
    return Launch("walk", (_cdiv(V, BV), B * H, 1), args, const, cfg["num_warps"],
                  cfg["num_stages"])


def matrix_program(variant: str, *, B: int, T: int, H: int, K: int, V: int,
                   dtype: torch.dtype, gated: bool, has_h0: bool, store_o: bool = True,
                   scale: Optional[float] = None, execution: Optional[str] = None,
                   interp: bool = False, tiles: Optional[dict] = None,
                   gate_dtype: torch.dtype = torch.float32) -> Program:
    """Program of one matrix-state segment forward (or, ``store_o=False``, its summary).

    Buffers: inputs ``q, k, v`` (``dtype``), ``g`` (``gate_dtype``, ``[B, T, H]`` or ``[B, T, H, K]``
    for gla), ``beta`` (gated_delta_rule, ``gate_dtype``), ``h0`` (fp32 ``[B, H, K, V]``); outputs ``o``
    (``dtype``) and ``ht`` (fp32); workspaces by pattern.  ``execution`` forces fused or
    decoupled (scalar decay only); ``None`` asks the scheduler (Algorithm 1), as the
    kernels do.  ``tiles`` overrides entries of the kernels' tile config.
    """
    from ..kernels import scheduler

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

    if variant in ("linear_attn", "simple_gla"):
        from ..kernels import scalar

        cfg_f = dict(scalar.fused_config(K, V), **(tiles or {}))
        strategy = scheduler.FUSED
        if store_o:  # the summary is always the fused walk (as ScalarDecayWork._summary_fwd)
            strategy, reason = scheduler.choose(B, T, H, K, V, cfg_f["BT"], cfg_f["BV"],
                                                elem_size=torch.empty((), dtype=dtype).element_size(),
                                                request=execution)
            notes.append(f"execution {strategy}: {reason}")
        if strategy == scheduler.DECOUPLED:
            cfg = dict(scalar.decoupled_config(K, V), **(tiles or {}))
            BT, BK, BV = cfg["BT"], _pow2(K), min(cfg["BV"], _pow2(V))
            NT, NV = _cdiv(T, BT), _cdiv(V, BV)
            bufs["h"] = Buffer((B, H, NT, K, V), torch.float32, "workspace")
            gate = 1 if gated else 0
            gg = g or "k"
            common = (("H", H), ("K", K), ("V", V), ("BT", BT), ("BK", BK), ("BV", BV),
                      ("GATE", gate))
            nw, ns = cfg["num_warps"], cfg["num_stages"]
            launches = [
                Launch("chunk_state", (NV, NT, B * H),
                       (("k", "buf", "k"), ("v", "buf", "v"), ("g", "buf", gg),
                        ("h", "buf", "h"), ("T", "i32", T)),
                       common + (("PREC", prec),), nw, ns),
                Launch("chunk_scan", (NV, B * H, 1),
                       (("g", "buf", gg), ("h", "buf", "h"), ("h0", "buf", h0 or "ht"),
                        ("ht", "buf", "ht"), ("T", "i32", T)),
                       common + (("HAS_H0", has_h0),), nw, ns),
                Launch("chunk_output", (NV, NT, B * H),
                       (("q", "buf", "q"), ("k", "buf", "k"), ("v", "buf", "v"),
                        ("g", "buf", gg), ("h", "buf", "h"), ("o", "buf", "o"),
                        ("T", "i32", T), ("scale", "fp32", scale)),
                       common + (("PREC", prec),), nw, ns)]
            return Program(launches, bufs, scheduler.DECOUPLED, notes)
        ln = _walk(bufs, q=q, k="k", v="v", g=g, w=None, h0=h0, o=o, ht="ht", B=B, T=T, H=H,
                   K=K, V=V, gate=1 if gated else 0, scale=scale, cfg=cfg_f, prec=prec)
        return Program([ln], bufs, scheduler.FUSED, notes)

    if execution not in (None, "auto", scheduler.FUSED):
        raise ValueError(f"execution={execution!r}: {variant} has only the fused kernels")
    if variant == "gla":
        from ..kernels import vector

        cfg = dict(vector.fused_config(K, V), **(tiles or {}))
        launches: List[Launch] = []
        a = None
        if store_o and not interp:  # the kernels skip the intra kernel under the interpreter
            BT = cfg["BT"]
            bufs["a"] = Buffer((B, T, H, BT), torch.float32, "workspace")
            launches.append(Launch(
                "gla_intra", (_cdiv(T, BT), B * H, 1),
                (("q", "buf", "q"), ("k", "buf", "k"), ("g", "buf", "g"), ("a", "buf", "a"),
                 ("T", "i32", T)),
                (("H", H), ("K", K), ("BT", BT), ("BK", _pow2(K))),
                vector.INTRA_CONFIG["num_warps"], 3))  # 3: Triton's default num_stages
            a = "a"
        launches.append(_walk(bufs, q=q, k="k", v="v", g="g", w=None, h0=h0, o=o, ht="ht",
                              B=B, T=T, H=H, K=K, V=V, gate=2, scale=scale, cfg=cfg,
                              prec=prec, a=a))
        return Program(launches, bufs, scheduler.FUSED, notes)

    # gated_delta_rule
    from ..kernels import delta

    if not store_o:
        raise ValueError("gated_delta_rule: the summary program (with its dense transition) "
                         "is not built here; use forge_dist.ops for sequence parallelism")
    cfg = dict(delta.fused_config(K, V), **(tiles or {}))
    bufs["beta"] = Buffer((B, T, H), gate_dtype, "input")
    low = dtype in (torch.float16, torch.bfloat16)
    wy_prec = "tf32" if low and prec != "ieee" else prec
    BT = cfg["BT"]
    bufs["w"] = Buffer((B, T, H, K), dtype, "workspace")
    bufs["u"] = Buffer((B, T, H, V), dtype, "workspace")
    wy = Launch("wy", (_cdiv(T, BT), B * H, 1),
                (("k", "buf", "k"), ("v", "buf", "v"), ("g", "buf", g or "beta"),
                 ("beta", "buf", "beta"), ("w", "buf", "w"), ("u", "buf", "u"),
                 ("T", "i32", T)),
                (("H", H), ("K", K), ("V", V), ("BT", BT), ("BK", _pow2(K)),
                 ("BV", min(delta.WY_CONFIG["BV"], _pow2(V))), ("LOG2BT", BT.bit_length() - 1),
                 ("GATE", 1 if gated else 0), ("PREC", wy_prec)),
                delta.WY_CONFIG["num_warps"], delta.WY_CONFIG["num_stages"])
    ln = _walk(bufs, q="q", k="k", v="u", g=g, w="w", h0=h0, o="o", ht="ht", B=B, T=T, H=H,
               K=K, V=V, gate=1 if gated else 0, scale=scale, cfg=cfg, prec=prec)
    return Program([wy, ln], bufs, scheduler.FUSED, notes)


def hgrn_program(*, B: int, T: int, D: int, dtype: torch.dtype, has_h0: bool,
                 store_o: bool = True, tiles: Optional[dict] = None,
                 gate_dtype: Optional[torch.dtype] = None) -> Program:
    """Program of one hgrn segment: inputs ``x [B, T, D]``, ``g [B, T, D]`` (``gate_dtype``,
    default ``dtype``),
    ``h0 [B, D]`` fp32; outputs ``o [B, T, D]`` and ``ht [B, D]`` fp32."""
    from ..kernels import vector_state

    cfg = dict(vector_state.FUSED_CONFIG, **(tiles or {}))
    bufs = {"x": Buffer((B, T, D), dtype, "input"),
            "g": Buffer((B, T, D), gate_dtype or dtype, "input"),
            "ht": Buffer((B, D), torch.float32, "output")}
    if store_o:
        bufs["o"] = Buffer((B, T, D), dtype, "output")
    if has_h0:
        bufs["h0"] = Buffer((B, D), torch.float32, "input")
    ln = Launch("hgrn", (_cdiv(D, cfg["BD"]), B, 1),
                (("x", "buf", "x"), ("g", "buf", "g"), ("h0", "buf", "h0" if has_h0 else "ht"),
                 ("o", "buf", "o" if store_o else "ht"), ("ht", "buf", "ht"), ("T", "i32", T)),
                (("D", D), ("BT", cfg["BT"]), ("BD", cfg["BD"]), ("HAS_H0", has_h0),
                 ("STORE_O", store_o)),
                cfg["num_warps"], cfg["num_stages"])
    return Program([ln], bufs, "fused", [])


def grid_size(grid) -> int:
    return math.prod(grid)

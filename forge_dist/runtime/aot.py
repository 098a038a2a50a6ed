"""Ahead-of-time compilation of the kernels into an on-disk cubin cache (no GPU needed).

A config declares the static dims (variants, heads, head dims, dtypes, chunk sizes,
execution modes); :func:`enumerate_specs` turns it into the set of
:class:`~forge_dist.kernels.ir.KernelSpec` that plans of those dims launch (built by
the same program builders the plans use), and :func:`compile_all` compiles each for a
target such as ``cuda:90`` with Triton 3.6's own compiler::

    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                   options=make_backend(target).parse_options({"num_warps": .., "num_stages": ..}))

which runs the whole pipeline on the CPU (``ptxas`` ships inside the triton wheel).

Cache layout (``cache_dir``)::

    manifest.json            header (format, triton, torch, target, ptxas) + one entry per kernel
    cubins/<key>.cubin       the binaries, <key> = KernelSpec.key

An entry records the kernel's module and name, its source hash (Triton's
``JITFunction.cache_key``: the source, the jit functions it calls and the globals it reads),
the signature, constexprs, options, the cubin's sha256 and metadata (entry name, shared
memory, warps, scratch sizes).  A cache is *valid* for this process only if the header's
triton and torch versions and target equal the process's and each entry's source hash equals
the kernel's current one and its cubin's sha256 matches; anything else is stale:
:func:`compile_all` rebuilds it and :class:`CubinCache` never hands it out.

Triton's interpreter (``TRITON_INTERPRET=1``) replaces the kernels by Python functions that
cannot be compiled or hashed; under it, :func:`compile_specs` and :func:`verify` run
themselves in a child process with the interpreter off (same Python, same ``sys.path``).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .. import kernels
from ..kernels import backward_program, forward_program
from ..kernels.ir import KERNELS, KernelSpec, resolve_kernel
from ..variants import registry
from ..variants.transitions import Kind

FORMAT = 1
MANIFEST = "manifest.json"

# The AOT config (TOML through forge_dist.config): every key, with its default.
DEFAULTS: Dict[str, Any] = {
    "target": "cuda:90",
    "variants": list(kernels.variants()),
    "heads": [32],
    "head_dims": [[128, 128]],       # [K, V] pairs of the matrix-state variants
    "hgrn_dims": [4096],             # D of hgrn
    "dtypes": ["bfloat16"],          # q/k/v (hgrn x, g) dtypes
    "gate_dtype": "float32",         # g / beta of the matrix-state variants
    "beta_dtype": "",                # the delta rule's beta when it differs ("": gate_dtype)
    "execution": ["fused", "decoupled"],  # decoupled: not for the delta rule's dense state
    "gated": [True],                 # variants whose gate is optional: with g (False: none)
    "initial_state": [False, True],  # HAS_H0 off / on
    "sequence_parallel": True,       # also the summary programs a sequence-parallel plan runs
    "backward": True,                # also the backward programs (the plans' run_backward)
    "batch_sizes": [1],              # B of the backward programs (their walk tiles shrink
                                     # with B * H to fill the SMs; others fall back to the JIT)
    "chunk_sizes": [],               # BT overrides ([]: the kernels' own tile tables)
}


def parse_target(target: str) -> Tuple[str, int, int]:
    """``"cuda:90"`` / ``"cuda:90:32"`` -> ``("cuda", 90, 32)``."""
    parts = str(target).split(":")
    if len(parts) not in (2, 3) or parts[0] != "cuda" or not parts[1].isdigit():
        raise ValueError(f"target: expected 'cuda:<arch>[:<warp size>]' such as 'cuda:90', "
                         f"got {target!r}")
    return "cuda", int(parts[1]), int(parts[2]) if len(parts) == 3 else 32


def target_name(target: str) -> str:
    b, arch, ws = parse_target(target)
    return f"{b}:{arch}:{ws}"


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def versions(target: str) -> Dict[str, Any]:
    """The header a cache must match: format, triton, torch, target (and ptxas, recorded)."""
    import triton  # optional: the gpu extra

    head = {"format": FORMAT, "triton": triton.__version__, "torch": torch.__version__,
            "target": target_name(target)}
    return head


def ptxas_version(target: str = "cuda:90") -> Optional[str]:
    """Version of the ptxas Triton would use for ``target`` (``None``: not available)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # optional: the gpu extra

        tool = get_ptxas(parse_target(target)[1])
        return str(tool.version) if tool.path and os.path.exists(tool.path) else None
    except Exception:  # noqa: BLE001 - any failure means "cannot compile here"
        return None


# ---------------------------------------------------------------------------------------
# What to compile
# ---------------------------------------------------------------------------------------

def enumerate_specs(cfg: Dict[str, Any]) -> List[KernelSpec]:
    """Every kernel spec that plans of the config's static dims launch (deduplicated)."""
    out: Dict[str, KernelSpec] = {}
    bts = list(cfg.get("chunk_sizes") or [None])
    gate_dtype = _dtype(cfg.get("gate_dtype", "float32"))
    beta_dtype = _dtype(cfg["beta_dtype"]) if cfg.get("beta_dtype") else None
    for variant in cfg["variants"]:
        for dt_name in cfg["dtypes"]:
            dtype = _dtype(dt_name)
            for h0 in cfg["initial_state"]:
                if registry.get(variant).vector_state:
                    for D in cfg["hgrn_dims"]:
                        for store_o in ([True, False] if cfg["sequence_parallel"] else [True]):
                            for mode in cfg["execution"]:
                                if not store_o and h0:
                                    continue  # summaries start from zero
                                prog = forward_program(variant, B=1, T=256, D=int(D),
                                                       dtype=dtype, has_h0=h0,
                                                       store_o=store_o, execution=mode)
                                out.update((s.key, s) for s in prog.specs())
                                if store_o and cfg["sequence_parallel"]:
                                    # a rank's plan: the folded summary (before the last
                                    # rank), the incoming state (every rank but rank 0)
                                    for summary, has_in in (("folded", h0), ("folded", True),
                                                            ("incoming", True)):
                                        prog = forward_program(
                                            variant, B=1, T=256, D=int(D), dtype=dtype,
                                            has_h0=has_in, execution=mode, summary=summary)
                                        out.update((s.key, s) for s in prog.specs())
                                if not (store_o and cfg.get("backward", True)):
                                    continue
                                for has_dht in (False, True):
                                    prog = backward_program(
                                        variant, B=1, T=256, D=int(D), dtype=dtype, has_h0=h0,
                                        has_dht=has_dht, execution=mode)
                                    out.update((s.key, s) for s in prog.specs())
                    continue
                for H, (K, V), bt, T in itertools.product(cfg["heads"], cfg["head_dims"],
                                                          bts, _matrix_lengths()):
                    tiles = None if bt is None else {"BT": int(bt)}
                    for gated, mode, summary in itertools.product(
                            _gates(variant, cfg["gated"]), _modes(variant, cfg["execution"]),
                            _summaries(variant, cfg["sequence_parallel"])):
                        prog = forward_program(
                            variant, B=1, T=T, H=int(H), K=int(K), V=int(V), dtype=dtype,
                            gated=gated, has_h0=h0, execution=mode, tiles=tiles,
                            gate_dtype=gate_dtype, beta_dtype=beta_dtype, summary=summary)
                        out.update((s.key, s) for s in prog.specs())
                    if not cfg.get("backward", True) or bt is not None:
                        continue  # the backward kernels keep their own chunk sizes
                    for gated, Bb, has_dht in itertools.product(
                            _gates(variant, cfg["gated"]), cfg.get("batch_sizes", [1]),
                            (False, True)):
                        prog = backward_program(
                            variant, B=int(Bb), T=T, H=int(H), K=int(K), V=int(V),
                            dtype=dtype, gated=gated, has_h0=h0, has_dht=has_dht,
                            beta_dtype=beta_dtype or gate_dtype)
                        out.update((s.key, s) for s in prog.specs())
    return list(out.values())


def _matrix_lengths() -> Tuple[int, int]:
    """Sequence lengths whose programs cover every kernel a matrix-state plan can launch:
    short simple_gla inputs sum the scalar gates in the walks, long ones launch a gate sum
    first (``kernels.walker.sum_gates_in_walk``); nothing else in a spec depends on T."""
    from ..kernels import walker  # lazy: its kernels cost ~13 ms; only AOT builds read this

    return 256, walker.SUM_GATES_IN_WALK_MAX_TOKENS + 256


def _gates(variant, gated):
    spec = registry.get(variant)
    if spec.gate is None:
        return [False]
    if not spec.gate_optional:
        return [True]
    return sorted(set(bool(g) for g in gated))


def _modes(variant, modes):
    if registry.get(variant).kind is not Kind.DENSE:  # segments need a diagonal transition
        return list(modes)
    return ["fused"] if "fused" in modes or modes else []


def _summaries(variant, sp):
    """The ``summary=`` forms a plan of ``variant`` may take: a sequence-parallel rank's
    (forge's segments, the baselines' folded summaries; the delta rule's state alone or
    with its dense transition) besides the plain one."""
    if not sp:
        return ["none"]
    if registry.get(variant).kind is Kind.DENSE:
        return ["none", "state", "folded"]
    return ["none", "segments", "folded"]


# ---------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------

def source_hash(kernel: str) -> str:
    """Triton's ``cache_key`` of the kernel (source, callees, globals); not under the
    interpreter."""
    fn = resolve_kernel(kernel)
    key = getattr(fn, "cache_key", None)
    if key is None:
        raise RuntimeError(f"{kernel}: no Triton source hash (is TRITON_INTERPRET=1 set?); "
                           "compile and verify in a process without the interpreter")
    return key


def _compile_one(spec: KernelSpec, target: str):
    import triton  # optional: the gpu extra (AOT builds only)
    from triton.backends.compiler import GPUTarget  # optional: as above
    from triton.compiler import ASTSource, make_backend

    fn = resolve_kernel(spec.kernel)
    const = dict(spec.constexprs)
    types = dict(spec.signature)
    signature, attrs = {}, {}
    defaults = {p.name: p.default for p in fn.params if p.has_default and p.is_constexpr}
    for i, name in enumerate(fn.arg_names):
        if name not in const and name not in types and name in defaults:
            const[name] = defaults[name]  # a constexpr the launch leaves at its default
        if name in const:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
            if types[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # what the JIT assumes for aligned pointers
        else:
            raise ValueError(f"{spec.kernel}: parameter {name!r} is neither bound nor constexpr")
    runtime = [n for n in fn.arg_names if n not in const]
    if runtime != [n for n, _ in spec.signature]:
        raise ValueError(f"{spec.kernel}: runtime parameters {runtime} != spec "
                         f"{[n for n, _ in spec.signature]}")
    b, arch, ws = parse_target(target)
    tgt = GPUTarget(b, arch, ws)
    backend = make_backend(tgt)
    options = backend.parse_options({"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    src = ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs)
    return triton.compile(src, target=tgt, options=options.__dict__)


def _load_manifest(cache_dir: Path) -> Optional[Dict[str, Any]]:
    path = cache_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_manifest(cache_dir: Path, manifest: Dict[str, Any]) -> None:
    tmp = cache_dir / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, cache_dir / MANIFEST)  # atomic: readers never see half a manifest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stale_reason(entry: Dict[str, Any], header: Dict[str, Any], want: Dict[str, Any],
                 cache_dir: Path, hashes: Dict[str, str]) -> Optional[str]:
    """Why ``entry`` may not be used (``None``: valid)."""
    for k in ("format", "triton", "torch", "target"):
        if header.get(k) != want[k]:
            return f"{k} {header.get(k)!r} != {want[k]!r}"
    kern = entry.get("kernel")
    if kern not in hashes:
        try:
            hashes[kern] = source_hash(kern)
        except Exception as err:  # noqa: BLE001 - a kernel that no longer exists is stale
            hashes[kern] = f"<unavailable: {err}>"
    if entry.get("source_hash") != hashes[kern]:
        return f"source of {kern} changed"
    path = cache_dir / entry.get("cubin", "")
    if not path.is_file():
        return "cubin missing"
    if _sha(path.read_bytes()) != entry.get("cubin_sha256"):
        return "cubin checksum mismatch"
    return None


def compile_specs(specs: Iterable[KernelSpec], cache_dir, target: str = "cuda:90", *,
                  progress: bool = False, force: bool = False) -> Dict[str, Any]:
    """Compile ``specs`` into ``cache_dir``, reusing valid entries; returns a report
    ``{"compiled": [keys], "reused": [keys], "stale": {key: reason}, "seconds": s}``."""
    specs = list(specs)
    if interpreting():
        return _in_child("compile", specs, cache_dir, target, force=force)
    cache_dir = Path(cache_dir)
    (cache_dir / "cubins").mkdir(parents=True, exist_ok=True)
    want = versions(target)
    manifest = _load_manifest(cache_dir) or {}
    header = manifest.get("header", {})
    header_ok = all(header.get(k) == want[k] for k in ("format", "triton", "torch", "target"))
    entries: Dict[str, Any] = dict(manifest.get("kernels", {})) if header_ok else {}
    old = manifest.get("kernels", {})
    report: Dict[str, Any] = {"compiled": [], "reused": [], "stale": {}, "cache_dir": str(cache_dir)}
    hashes: Dict[str, str] = {}
    t_start = time.time()
    for n, spec in enumerate(specs):
        key = spec.key
        if key in old and not force:
            why = stale_reason(old[key], header, want, cache_dir, hashes)
            if why is None:
                report["reused"].append(key)
                entries[key] = old[key]
                continue
            report["stale"][key] = why
        t0 = time.time()
        ck = _compile_one(spec, target)
        cubin = ck.asm["cubin"]
        rel = f"cubins/{key}.cubin"
        (cache_dir / rel).write_bytes(cubin)
        md = ck.metadata
        if spec.kernel not in hashes:
            hashes[spec.kernel] = source_hash(spec.kernel)
        module, attr = _kernel_location(spec.kernel)
        entries[key] = {
            **spec.to_json(), "module": module, "function": attr,
            "source_hash": hashes[spec.kernel], "cubin": rel, "cubin_sha256": _sha(cubin),
            "name": md.name, "shared": int(md.shared),
            "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
            "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
            "num_ctas": int(getattr(md, "num_ctas", 1)),
            "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
            "launch_pdl": bool(getattr(md, "launch_pdl", False)),
            "compile_s": round(time.time() - t0, 3)}
        report["compiled"].append(key)
        if progress:
            print(f"[{n + 1}/{len(specs)}] {spec.kernel} {key} shared={md.shared} "
                  f"warps={spec.num_warps} ({time.time() - t0:.1f}s)", flush=True)
        # write as we go: an interrupted build keeps what it finished
        _write_manifest(cache_dir, {"header": dict(want, ptxas=ptxas_version(target)),
                                    "kernels": entries})
    _write_manifest(cache_dir, {"header": dict(want, ptxas=ptxas_version(target)),
                                "kernels": entries})
    report["seconds"] = round(time.time() - t_start, 2)
    return report


def _kernel_location(kernel: str) -> Tuple[str, str]:
    if ":" in kernel:
        m, a = kernel.split(":", 1)
        return m, a
    return KERNELS[kernel]


def compile_all(config: Dict[str, Any], target: Optional[str] = None, cache_dir=None, *,
                progress: bool = False, force: bool = False) -> Dict[str, Any]:
    """Compile every kernel the config's static dims need (see :data:`DEFAULTS` for keys).

    ``config``: a dict (e.g. from ``forge_dist.config.load(aot.DEFAULTS, path)``); missing
    keys take their defaults.  Returns the report of :func:`compile_specs` plus ``"specs"``.
    """
    cfg = dict(DEFAULTS)
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown AOT config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg.update(config)
    target = target or cfg["target"]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    specs = enumerate_specs(cfg)
    report = compile_specs(specs, cache_dir, target, progress=progress, force=force)
    report["specs"] = len(specs)
    return report


def default_cache_dir() -> Path:
    """``$FORGE_DIST_AOT_CACHE`` or ``~/.cache/forge_dist/aot``."""
    env = os.environ.get("FORGE_DIST_AOT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "forge_dist" / "aot"


def verify(cache_dir, target: str = "cuda:90") -> Dict[str, Any]:
    """``{"valid": [keys], "stale": {key: reason}}`` for the cache as this process sees it."""
    if interpreting():
        return _in_child("verify", [], cache_dir, target)
    cache_dir = Path(cache_dir)
    manifest = _load_manifest(cache_dir)
    if manifest is None:
        return {"valid": [], "stale": {}, "missing_manifest": True}
    want = versions(target)
    header = manifest.get("header", {})
    hashes: Dict[str, str] = {}
    valid, stale = [], {}
    for key, entry in manifest.get("kernels", {}).items():
        why = stale_reason(entry, header, want, cache_dir, hashes)
        if why is None:
            valid.append(key)
        else:
            stale[key] = why
    return {"valid": valid, "stale": stale}


class CubinCache:
    """The valid entries of an on-disk cache, for the dispatcher.  Stale entries are never
    returned: :meth:`entry` gives ``None`` and the plan falls back to the JIT."""

    def __init__(self, cache_dir, target: str = "cuda:90"):
        self.cache_dir = Path(cache_dir)
        self.target = target
        manifest = _load_manifest(self.cache_dir) or {}
        self.header = manifest.get("header", {})
        self._all = manifest.get("kernels", {})
        self._want = versions(target)
        self._hashes: Dict[str, str] = {}
        self._checked: Dict[str, Optional[str]] = {}
        self._bytes: Dict[str, bytes] = {}

    def stale(self, key: str) -> Optional[str]:
        """Why ``key`` cannot be used (``None``: usable)."""
        if key not in self._all:
            return "not in the cache"
        if key not in self._checked:
            self._checked[key] = stale_reason(self._all[key], self.header, self._want,
                                              self.cache_dir, self._hashes)
        return self._checked[key]

    def entry(self, key: str) -> Optional[Dict[str, Any]]:
        return self._all[key] if self.stale(key) is None else None

    def cubin(self, key: str) -> bytes:
        if key not in self._bytes:
            if self.entry(key) is None:
                raise KeyError(f"{key}: {self.stale(key)}")
            self._bytes[key] = (self.cache_dir / self._all[key]["cubin"]).read_bytes()
        return self._bytes[key]


# ---------------------------------------------------------------------------------------
# Child process (interpreter on in the parent)
# ---------------------------------------------------------------------------------------

def _in_child(action: str, specs: List[KernelSpec], cache_dir, target: str,
              force: bool = False) -> Dict[str, Any]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] +
                                        [env.get("PYTHONPATH", "")]).strip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "req.json", Path(tmp) / "res.json"
        req.write_text(json.dumps({"action": action, "specs": [s.to_json() for s in specs],
                                   "cache_dir": str(cache_dir), "target": target,
                                   "force": force}))
        proc = subprocess.run([sys.executable, "-m", "forge_dist.runtime.aot", str(req), str(res)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"AOT {action} in a child process failed:\n{proc.stderr[-4000:]}")
        return json.loads(res.read_text())


def _child_main(argv: List[str]) -> int:
    req = json.loads(Path(argv[0]).read_text())
    if req["action"] == "compile":
        out = compile_specs([KernelSpec.from_json(s) for s in req["specs"]], req["cache_dir"],
                            req["target"], force=req["force"])
    else:
        out = verify(req["cache_dir"], req["target"])
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

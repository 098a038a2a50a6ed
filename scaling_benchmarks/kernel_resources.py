"""Compile-time resources of every kernel for Hopper (sm_90), no GPU needed.

Each kernel that the single-device benchmark shape launches (forward: the plans of
:mod:`forge_dist.runtime.aot` for B=1, H=32, K=V=128, hgrn D=4096, bf16; backward: the
``kernel_specs`` of each backward module) is compiled with Triton's own compiler, then its
PTX is assembled again with Triton's bundled ``ptxas -v`` to read what the compiler does not
report without a GPU: registers per thread and bytes spilled to local memory.  Shared memory
per block comes from Triton's metadata.  A spill costs local-memory traffic in a kernel's
inner loop, so this is where tile sizes are tuned before a GPU is at hand; it says nothing
about time.

    python scaling_benchmarks/kernel_resources.py [--out DIR] [--K 128] [--V 128]

Writes ``kernel_resources_cpu_<date>.json`` and a PNG beside it.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import registry, results_io  # noqa: E402

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


def _ptxas_report(ptx: str, arch: str = "sm_90a") -> dict:
    """``{"registers", "spill_stores", "spill_loads", "stack"}`` from ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(90)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([tool.path, f"-arch={arch}", "-v", f.name, "-o", "/dev/null"],
                         capture_output=True, text=True, check=True).stderr
    Path(f.name).unlink()

    def num(pattern):
        m = re.search(pattern, out)
        return int(m.group(1)) if m else None
    return {"registers": num(r"Used (\d+) registers"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"),
            "stack": num(r"(\d+) bytes stack frame")}


def specs(K: int, V: int, H: int, D: int):
    """``[(pattern, pass, KernelSpec)]`` at the benchmark shape."""
    import torch

    from forge_dist.kernels import delta_backward, scalar_backward, vector_backward, vector_state
    from forge_dist.runtime import aot

    out = []
    for variant in registry.NAMES:  # the benchmarked ops
        cfg = dict(aot.DEFAULTS, variants=[variant], heads=[H], head_dims=[[K, V]],
                   hgrn_dims=[D], dtypes=["bfloat16"], execution=["fused"],
                   initial_state=[True], sequence_parallel=False, backward=False)
        out += [(variant, "fwd", s) for s in aot.enumerate_specs(cfg)]
    out += [("simple_gla", "bwd", s) for s in scalar_backward.kernel_specs(K, V, H=H)]
    out += [("gla", "bwd", s) for s in vector_backward.kernel_specs(K, V, torch.bfloat16, H=H)]
    out += [("gated_delta_rule", "bwd", s) for s in delta_backward.kernel_specs(K, V, H=H)]
    out += [("hgrn", "bwd", s) for s in vector_state.backward_kernel_specs(D)]
    return out


def measure(K: int, V: int, H: int, D: int, progress=None, only=None) -> dict:
    """The results file's content; ``only(op, pass, spec)`` filters the kernels."""
    from forge_dist.runtime import aot

    result = results_io.header("kernel_resources", {"target": "cuda:90", "ptxas_arch": "sm_90a",
                                                    "K": K, "V": V, "H": H, "hgrn_D": D,
                                                    "dtype": "bfloat16",
                                                    "ptxas": aot.ptxas_version("cuda:90")})
    todo = [t for t in specs(K, V, H, D) if only is None or only(*t)]
    for i, (op, pas, spec) in enumerate(todo):
        ck = aot._compile_one(spec, "cuda:90")
        row = {"op": op, "pass": pas, "kernel": spec.kernel.split(":")[-1],
               "num_warps": spec.num_warps, "num_stages": spec.num_stages,
               "constexprs": {k: v for k, v in spec.constexprs
                              if isinstance(v, (int, bool)) and k.isupper() and
                              k not in ("H", "K", "V", "D")},
               "shared_bytes": int(ck.metadata.shared), **_ptxas_report(ck.asm["ptx"])}
        row["fits"] = row["shared_bytes"] <= SHARED_LIMIT
        result["rows"].append(row)
        if progress:
            progress(i + 1, len(todo), row)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shown = ("GRADS", "STORE_CHUNKS", "STORE_X", "FUSE_DV", "STORE_O")
    labels = [f"{r['op']} {r['pass']}\n{r['kernel']} "
              + " ".join(f"{k}={int(v)}" for k, v in r["constexprs"].items() if k in shown)
              for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.35 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    ax1.barh(y, [r["registers"] or 0 for r in rows], color="tab:blue")
    ax1.axvline(255, color="grey", ls="--", lw=0.8)
    ax1.set_xlabel("registers per thread (255: the limit)")
    ax2.barh(y, [r["spill_stores"] or 0 for r in rows], color="tab:red")
    ax2.set_xlabel("bytes spilled per thread (stores)")
    ax1.set_yticks(list(y), labels, fontsize=7)
    ax1.invert_yaxis()
    fig.suptitle(f"sm_90 compile-time resources, bf16, K=V={result['config']['K']}, "
                 f"commit {result['commit'][:7]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default scaling_benchmarks/results)")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=4096, help="hgrn width")
    args = ap.parse_args(argv)

    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        print("kernel_resources.py needs Triton's bundled ptxas", file=sys.stderr)
        return 2

    def progress(i, n, row):
        print(f"[{i}/{n}] {row['op']:17s} {row['pass']} {row['kernel']:18s} "
              f"regs {row['registers']} spill {row['spill_stores']} B "
              f"shared {row['shared_bytes']} B", flush=True)

    result = measure(args.K, args.V, args.H, args.D, progress)
    path = results_io.write(result, Path(args.out) if args.out else None)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

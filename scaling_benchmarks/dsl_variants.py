"""The catalogue of user-written DSL variants (tests/dsl/catalogue.py) against the built-ins.

For every runnable catalogue entry: the forward of the DSL variant (through whichever path
``describe()`` reports: a Triton template, or the generated path) against the forward of
the nearest built-in op of the same transition kind on inputs mapped beforehand (the
prologues', gates' and extra inputs' work left out: a floor).  Targets (issue 36): a
template-lowered variant <= 1.2x the built-in, the generated path <= 3x (also a template
plus a chunk-local residual, ``residual:<template>``: no template fits the program).

Shapes: B=1, H=32, K=V=128, T=16K (``--T``), bf16 (per-head gates fp32); vector-state
variants x [1, T, 4096].  Rows (``impl``): ``dsl`` (with its ``path``, ``ratio`` to the
built-in, ``target``, ``meets_target`` and the first call's seconds, compilation included)
and ``builtin``; a variant that fails or is not reached within ``--budget-s`` gets a row
with ``error`` / ``skipped``.  The JSON is rewritten after every row; the PNG at the end.

    python -m scaling_benchmarks.dsl_variants [--variants a,b] [--path template|generated]
        [--T 16384] [--out DIR] [--tag X] [--budget-s 420]

With ``--sp`` each variant and its built-in run sequence-parallel against one shard
(:mod:`scaling_benchmarks.dsl_variants_sp`; issue 36: with 2 ranks a variant costs no more
over its one-shard time than the built-in does):

    torchrun --nproc-per-node 2 -m scaling_benchmarks.dsl_variants --sp --T 16384
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

B, H, K, V, D = 1, 32, 128, 128, 4096
SCALE = K ** -0.5
TARGET = {"template": 1.2, "generated": 3.0}


def _inputs(entry, T: int, device: str, heads: int, dim: int):
    """Token inputs: features bf16, per-head scalars fp32 (as gates come)."""
    x, _ = entry.problem(T, B=B, H=heads, K=K, V=V, D=dim, seed=0, dtype=torch.float32,
                         device=device)
    return {n: t if entry.inputs[n] == "" else t.to(torch.bfloat16) for n, t in x.items()}


def _builtin(entry, x):
    """The built-in op and its inputs mapped beforehand (gates fp32, features bf16)."""
    from forge_dist import ops

    with torch.no_grad():
        m = entry.mapped({n: t.float() for n, t in x.items()})
    feat = lambda t: t.to(torch.bfloat16)  # noqa: E731
    if entry.builtin == "hgrn":
        return ops.hgrn, dict(x=feat(m["x"]), g=feat(m["g"]))
    args = dict(q=feat(m["q"]), k=feat(m["k"]), v=feat(m["v"]), scale=SCALE)
    if entry.builtin == "linear_attn":
        return ops.linear_attn, args
    if entry.builtin == "gated_delta_rule":
        return ops.gated_delta_rule, dict(args, g=m.get("g"), beta=m["beta"])
    g = m["g"] if entry.builtin == "simple_gla" else feat(m["g"])
    return getattr(ops, entry.builtin), dict(args, g=g)


def _bench(fn, device: str, warmup: int, rep: int) -> float:
    """Milliseconds per call (Triton's do_bench on CUDA; a plain timer for the CPU smoke
    run)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep)
    fn()
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1e3


def path_label(v) -> str:
    """The path a CUDA call of variant ``v`` takes: ``template:<name>``, ``residual:<name>``
    (the template's kernels plus a chunk-local residual) or ``generated``."""
    kind = v.path(torch.device("cuda"))
    if kind != "template":
        return kind
    form = "residual" if v.lowering.residual is not None else "template"
    return f"{form}:{v.lowering.template}"


def _fwd(fn, kwargs):
    def run():
        with torch.no_grad():
            return fn(**kwargs)[0]
    return run


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["impl"] == "dsl" and "ratio" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows)), 4.2))
    colors = {"template": "tab:blue", "generated": "tab:orange", "residual": "tab:green"}
    ax.bar(range(len(rows)), [r["ratio"] for r in rows],
           color=[colors[r["path"].split(":")[0]] for r in rows])
    for kind, y in TARGET.items():
        ax.axhline(y, color=colors[kind], ls="--", lw=1, label=f"{kind} target {y}x")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['op']}\n({r['path']})" for r in rows], rotation=75, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("DSL fwd / built-in fwd (premapped)")
    ax.set_title(f"DSL catalogue, T={result['config']['T']}, bf16; {result['device']}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=None, help="comma-separated catalogue names")
    ap.add_argument("--path", choices=("template", "generated"), default=None,
                    help="only the entries expected on this path")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no variant after this many seconds (the run must end "
                         "inside 10 minutes; the generated path compiles at its first call)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu only to smoke-test the script (with a small --T and "
                         "--heads; its timings mean nothing)")
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--dim", type=int, default=D, help="vector-state width")
    sp = ap.add_argument_group("sequence parallel (--sp: each variant and its built-in, "
                               "sequence-parallel against one shard; dsl_variants_sp.py)")
    sp.add_argument("--sp", action="store_true",
                    help="under torchrun, or with --device cpu --world N; --T is then the "
                         "tokens per rank (--budget-s and --path do not apply)")
    sp.add_argument("--strategy", default="forge")
    sp.add_argument("--repeats", type=int, default=20, help="timed calls")
    sp.add_argument("--world", type=int, default=1,
                    help="with --device cpu: ranks to spawn when not launched by torchrun")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dsl_variants: needs a CUDA device (--device cpu for a smoke run)",
              file=sys.stderr)
        return 2

    from tests.dsl.catalogue import CATALOGUE, RUNNABLE

    names = RUNNABLE if args.variants is None else args.variants.split(",")
    if args.path is not None:
        names = [n for n in names if n in CATALOGUE and
                 CATALOGUE[n].path.split(":")[0] == args.path]
    unknown = [n for n in names if n not in RUNNABLE]
    if unknown:
        print(f"dsl_variants: --variants: unknown or not runnable {unknown}; choose from "
              f"{RUNNABLE}", file=sys.stderr)
        return 2
    if args.sp:
        from scaling_benchmarks import dsl_variants_sp

        args.names = names
        return dsl_variants_sp.main(args)
    result = results_io.header("dsl_variants", {"B": B, "H": args.heads, "K": K, "V": V,
                                                "D_vector": args.dim,
                                                "T": args.T, "dtype": "bfloat16",
                                                "pass": "fwd", "targets": TARGET})
    if args.tag:
        result["tag"] = args.tag
    start = time.time()
    path = None

    def emit(row):
        nonlocal path
        result["rows"].append(row)
        path = results_io.write(result, args.out)
        print(" ".join(f"{k}={v}" for k, v in row.items() if k != "describe"), flush=True)

    for name in names:
        entry = CATALOGUE[name]
        base = {"op": name, "T": args.T, "pass": "fwd", "builtin": entry.builtin}
        if time.time() - start > args.budget_s:
            emit(dict(base, impl="dsl", skipped=f"budget of {args.budget_s} s spent"))
            continue
        try:
            v = entry.variant
            label = path_label(v)  # the path a CUDA call takes
            x = _inputs(entry, args.T, args.device, args.heads, args.dim)
            fn, kw = _builtin(entry, x)
            builtin_ms = _bench(_fwd(fn, kw), args.device, 10, 50)
            emit(dict(base, impl="builtin", ms=builtin_ms))
            dsl_kw = dict(x, scale=SCALE) if entry.state == "matrix" else dict(x)
            t0 = time.time()
            _fwd(v, dsl_kw)()
            if args.device == "cuda":
                torch.cuda.synchronize()
            first_s = time.time() - t0
            ms = _bench(_fwd(v, dsl_kw), args.device, 5, 30)
            ratio = ms / builtin_ms
            # (a residual: the template's kernels plus generated chunk-local work, for a
            # program no template fits: the generated path's target)
            target = TARGET["template" if label.startswith("template:") else "generated"]
            emit(dict(base, impl="dsl", path=label, ms=ms, builtin_ms=builtin_ms,
                      ratio=ratio, target=target, meets_target=ratio <= target,
                      first_call_s=first_s, describe=v.describe()))
            del x, kw, dsl_kw
        except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end
            emit(dict(base, impl="dsl", error=f"{type(e).__name__}: {e}"[:500]))
            traceback.print_exc()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if path is not None:
        plot(result, path.with_suffix(".png"))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

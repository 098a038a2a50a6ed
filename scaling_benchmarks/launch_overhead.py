"""Launch overhead of one layer call: Triton JIT vs the static dispatcher vs CUDA graphs.

Paper section 4.3 (Figure 6): at T=1K the Triton runtime added ~207 us to a 47 us scalar-GLA
kernel.  This benchmark times one ``simple_gla`` forward (B=1, H=32, K=V=128, bf16, fp32
gate) at T in {1K, 2K, 4K, 8K} through:

* ``ops``      -- the public op ``forge_dist.ops.simple_gla`` without an AOT cache: a
  repeated call goes from the ops' front (``forge_dist/ops/planned.py``) to its cached
  plan, on the Triton backend (the kernels its first call compiled);
* ``ops_static`` -- the same op with ``FORGE_DIST_AOT_CACHE`` pointing at the cubins: its
  plan is a static one;
* ``jit``      -- a plan (``forge_dist.runtime.plan``) launching through Triton's JIT on
  every call (``FORGE_DIST_JIT_RELAUNCH=0``);
* ``jit_relaunch`` -- the same plan relaunching the kernels its first call compiled (the
  default without cubins, ``forge_dist/kernels/jit_launch.py``);
* ``static``   -- the same plan through the static dispatcher (AOT cubins, cuda.bindings):
  ``plan.run``, the run specialised to the plan (``forge_dist/runtime/fastpath.py``);
* ``static_general`` -- the same plan's general run (``Plan._run_general``: the loops over
  names and slots that the specialised run replaces; what ``static`` measured before it);
* ``static_ctypes`` -- the static dispatcher over libcuda through ctypes;
* ``static_ctypes_out`` -- the same with a preallocated output (``run(..., out=o)``);
* ``static_bound`` -- the static plan bound to fixed buffers once (``plan.bind``), then
  called: no per-call checks or packing, only the driver launches;
* ``raw_launch`` -- the floor of any Python-issued launch: the plan's cubins launched by
  bare ``cuLaunchKernel`` calls through ctypes with their parameters packed beforehand;
* ``graph``    -- a CUDA graph of the static plan's run, replayed;
* ``kernel``   -- GPU time alone (CUDA events around the graph replay of the launches);
* ``sync_only`` -- no call at all: what ``torch.cuda.synchronize()`` alone adds to the
  end-to-end time on this machine, a floor under every path's ``us_overhead``.

Per path and T, in microseconds: ``us_host`` (median Python time of one call, GPU idle
before it: the CPU-side overhead), ``us_e2e`` (median of call + synchronize, idle GPU
before: what a latency-bound caller sees), ``us_pipelined`` (back-to-back calls, wall time
per call: max of host and GPU time) and ``us_overhead = us_e2e - us_kernel``.  Each is the
median of ``--repeats`` medians of ``--iters`` calls (``us_e2e_runs``: the repeats' e2e),
since this host's numbers drift by several microseconds from one window to the next.  ``ms`` is
``us_e2e / 1000`` (the shared schema's latency field).  Results: JSON + PNG via
``results_io`` under ``scaling_benchmarks/results/``.

    python scaling_benchmarks/launch_overhead.py [--T 1024,2048,4096,8192] [--iters 200]
        [--cache-dir DIR] [--execution fused|decoupled] [--out DIR]
    python scaling_benchmarks/launch_overhead.py --merge A.json B.json ... [--tag TAG]
        # per (T, path): the median of the passes' values, their range in *_spread
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

B, H, K, V = 1, 32, 128, 128
T_ALL = (1024, 2048, 4096, 8192)
PATHS = ("ops", "ops_static", "jit", "jit_relaunch", "static", "static_general",
         "static_ctypes", "static_ctypes_out", "static_bound", "raw_launch", "graph",
         "sync_only", "kernel")


def make_inputs(T, device):
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=device, generator=gen, dtype=torch.float32)

    q, k, v = (r(B, T, H, d).to(torch.bfloat16) for d in (K, K, V))
    g = torch.nn.functional.logsigmoid(r(B, T, H) + 4)
    return q, k, v, g


def _without_relaunch(fn):
    """``fn`` with every plan launch going through Triton's JIT (its per-call path)."""
    import os

    def run():
        old = os.environ.get("FORGE_DIST_JIT_RELAUNCH")
        os.environ["FORGE_DIST_JIT_RELAUNCH"] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["FORGE_DIST_JIT_RELAUNCH"]
            else:
                os.environ["FORGE_DIST_JIT_RELAUNCH"] = old
    return run


def _host_and_e2e(fn, iters):
    """Median host time of one call and median call+sync time (GPU idle before each)."""
    host, e2e = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        e2e.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(e2e), min(e2e)


def _pipelined(fn, iters):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def _events(fn, iters):
    """Median GPU time of ``fn`` by CUDA events (fn must launch only GPU work)."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":"]
    for i, path in enumerate(p_ for p_ in PATHS if p_ != "kernel"):
        rows = [r for r in result["rows"] if r["dispatch"] == path]
        if not rows:
            continue
        Ts = [r["T"] for r in rows]
        kw = dict(marker="o", label=path, linestyle=styles[i // 10], color=f"C{i % 10}")
        if all(r.get("us_overhead") is not None for r in rows):
            ax[0].plot(Ts, [r["us_overhead"] for r in rows], **kw)
        ax[1].plot(Ts, [r["us_host"] for r in rows], **kw)
    ax[0].axhline(10, color="k", linewidth=0.8, linestyle="-.", label="10 us target")
    for a, title in zip(ax, ("end to end minus kernel time (us)", "host time of one call (us)")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("T")
        a.set_title(title)
        a.grid(True, which="both", alpha=0.3)
    ax[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"simple_gla fwd, B={B} H={H} K=V={K} bf16, {result['device']}"
                 + (f" ({len(result['passes'])}-pass median)" if "passes" in result else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=120)


METRICS = ("us_host", "us_e2e", "us_pipelined", "us_kernel", "us_overhead")


def merge(paths, tag=None, out=None) -> Path:
    """One results file from several passes of this benchmark (same config and commit):
    each row's metrics are the passes' median, ``<metric>_spread`` their [min, max]."""
    passes = [results_io.load(p_) for p_ in paths]
    first = passes[0]
    for other in passes[1:]:
        for field in ("benchmark", "device", "commit", "config"):
            if other[field] != first[field]:
                raise SystemExit(f"--merge: {field} differs between passes "
                                 f"({first[field]!r} vs {other[field]!r})")
    result = {k: v for k, v in first.items() if k != "rows"}
    result.update(tag=tag or "merged", passes=[str(p_) for p_ in paths], rows=[])
    for row in first["rows"]:
        same = [r for d in passes for r in d["rows"]
                if r["T"] == row["T"] and r["dispatch"] == row["dispatch"]
                and r.get("ms") is not None]
        if len(same) != len(passes):
            continue  # a path that failed in some pass
        merged = {k: v for k, v in row.items() if k not in METRICS + ("us_e2e_runs",)}
        for m in METRICS:
            vals = [r[m] for r in same if r.get(m) is not None]
            if vals:
                merged[m] = statistics.median(vals)
                merged[m + "_spread"] = [min(vals), max(vals)]
        merged["ms"] = merged["us_e2e"] / 1e3
        merged["ms_min"] = min(r["ms_min"] for r in same)
        result["rows"].append(merged)
    path = results_io.write(result, out or Path(paths[0]).parent)
    plot(result, path.with_suffix(".png"))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", default=",".join(str(t) for t in T_ALL))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5,
                   help="medians of --iters calls taken this many times per path; the "
                        "row is their median, us_e2e_runs lists them")
    p.add_argument("--cache-dir", default=None, help="AOT cache (default: a fresh build under "
                   "~/.cache/forge_dist/aot_bench)")
    p.add_argument("--execution", default="decoupled", choices=("fused", "decoupled"),
                   help="decoupled (the scheduler's choice at these shapes: two launches) or "
                        "fused (one launch, a 4 us step per chunk, 1.9x slower at T=1K)")
    p.add_argument("--out", default=None, help="results directory")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge passes of this benchmark into one file of medians")
    p.add_argument("--tag", default=None, help="the results file's tag (with --merge: the "
                   "merged file's)")
    args = p.parse_args(argv)
    if args.merge:
        print(f"wrote {merge(args.merge, args.tag, args.out)}")
        return 0
    if not torch.cuda.is_available():
        print("launch_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from forge_dist import ops
    from forge_dist.runtime import aot, plan
    from forge_dist.runtime.dispatcher import CtypesDriver, Dispatcher

    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    target = f"cuda:{major}{minor}"
    cache_dir = Path(args.cache_dir or Path.home() / ".cache" / "forge_dist" / "aot_bench")
    cfg = dict(variants=["simple_gla"], heads=[H], head_dims=[[K, V]], dtypes=["bfloat16"],
               execution=[args.execution], initial_state=[False], sequence_parallel=False)
    t0 = time.time()
    rep = aot.compile_all(cfg, target=target, cache_dir=cache_dir)
    print(f"AOT cache {cache_dir}: {len(rep['compiled'])} compiled, {len(rep['reused'])} "
          f"reused ({time.time() - t0:.1f}s)", flush=True)
    cache = aot.CubinCache(cache_dir, target)

    Ts = [int(t) for t in args.T.split(",") if t]
    result = results_io.header("launch_overhead", {
        "B": B, "H": H, "K": K, "V": V, "dtype": "bfloat16", "gate_dtype": "float32",
        "op": "simple_gla", "execution": args.execution, "iters": args.iters,
        "repeats": args.repeats,
        "target": target, "cache_dir": str(cache_dir)})
    if args.tag:
        result["tag"] = args.tag
    todo = [(T, path) for T in Ts for path in PATHS]
    plans = {}
    for T, path in tqdm(todo, desc="launch_overhead", file=sys.stdout):
        try:
            q, k, v, g = make_inputs(T, device)
            common = dict(B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device=device,
                          execution=args.execution)
            if path == "ops":
                fn = lambda: ops.simple_gla(q, k, v, g)  # noqa: E731
            elif path == "ops_static":
                import os

                from forge_dist.runtime import cache as plan_cache

                plan_cache.clear()  # the ops path's plan of this T has the same key
                os.environ["FORGE_DIST_AOT_CACHE"] = str(cache_dir)
                try:  # the plan is made (and its backend chosen) on the first call
                    ops.simple_gla(q, k, v, g)
                finally:
                    del os.environ["FORGE_DIST_AOT_CACHE"]
                pl = next(p_ for p_ in plan_cache._PLANS.values() if p_.op == "simple_gla"
                          and p_.shapes["q"][1] == T and p_.backend == "static")
                fn = lambda: ops.simple_gla(q, k, v, g)  # noqa: E731
            elif path == "sync_only":
                fn = lambda: None  # noqa: E731
            elif path == "jit":
                pl = plan("simple_gla", backend="triton", **common)
                fn = _without_relaunch(lambda: pl.run(q, k, v, g))
            elif path == "jit_relaunch":
                pl = plan("simple_gla", backend="triton", **common)
                fn = lambda: pl.run(q, k, v, g)  # noqa: E731
            elif path in ("static", "static_general", "static_ctypes", "static_ctypes_out"):
                disp = Dispatcher(cache, None if path in ("static", "static_general")
                                  else CtypesDriver())
                pl = plan("simple_gla", backend="static", dispatcher=disp, **common)
                plans[(T, path)] = pl
                if "run" not in vars(pl):
                    raise RuntimeError("the static plan was not specialised (a launch "
                                       f"without a cubin?): {pl.describe()['launches']}")
                if path == "static_ctypes_out":
                    o_buf = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=device)
                    fn = lambda: pl.run(q, k, v, g, out=o_buf)  # noqa: E731
                elif path == "static_general":
                    fn = lambda: pl._run_general(q, k, v, g)  # noqa: E731
                else:
                    fn = lambda: pl.run(q, k, v, g)  # noqa: E731
            elif path in ("static_bound", "raw_launch"):
                pl = plans[(T, "static_ctypes_out")]
                bound = pl.bind(q, k, v, g)
                fn = bound
                if path == "raw_launch":
                    if any(type(head) is not tuple for _, head, _ in bound._steps):
                        raise RuntimeError("raw_launch needs a plan of cubin launches")
                    stream = pl.finish_exec.stream()
                    raw = [(launch, (*head, stream, pack.params_address))
                           for launch, head, pack in bound._steps]

                    def fn(raw=raw):
                        for launch, launch_args in raw:
                            launch(*launch_args)
            else:  # graph / kernel: replay a graph of the static plan's run
                pl = (plans.get((T, "static")) or plans.get((T, "static_ctypes"))
                      or plan("simple_gla", backend="static", cache_dir=cache_dir, **common))
                out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=device)
                for _ in range(3):
                    pl.run(q, k, v, g, out=out)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    pl.run(q, k, v, g, out=out)
                fn = graph.replay
            describe = pl.describe() if path not in ("ops", "sync_only") else None
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
            kernel_us = None
            runs = []  # one (host, e2e, e2e_min, pipelined) per repeat, back to back
            for _ in range(args.repeats):
                if path == "kernel":
                    us = _events(fn, args.iters)
                    runs.append((None, us, us, us))
                else:
                    runs.append((*_host_and_e2e(fn, args.iters), _pipelined(fn, args.iters)))
            host, e2e, pipe = (None if runs[0][i] is None else
                               statistics.median(r[i] for r in runs) for i in (0, 1, 3))
            e2e_min = min(r[2] for r in runs)
            if path == "kernel":
                kernel_us = e2e
            row = {"op": "simple_gla", "T": T, "pass": "fwd", "impl": "forge_dist",
                   "dispatch": path, "ms": e2e / 1e3, "ms_min": e2e_min / 1e3,
                   "us_host": host, "us_e2e": e2e, "us_pipelined": pipe,
                   "us_e2e_runs": [r[1] for r in runs]}
            if describe is not None:
                row["launch_paths"] = [ln["path"] for ln in describe["launches"]]
            if path == "sync_only":
                row["us_overhead"] = e2e  # nothing to subtract
            result["rows"].append(row)
            if kernel_us is not None:
                for r in result["rows"]:
                    if r["T"] == T and r["dispatch"] != "sync_only":
                        r["us_kernel"] = kernel_us
                        if r.get("us_e2e") is not None:  # failed paths have none
                            r["us_overhead"] = r["us_e2e"] - kernel_us
        except Exception as err:  # noqa: BLE001 - record and go on with the other paths
            tqdm.write(f"[fail] T={T} {path}: {type(err).__name__}: {err}")
            traceback.print_exc()
            result["rows"].append({"op": "simple_gla", "T": T, "pass": "fwd",
                                   "impl": "forge_dist", "dispatch": path, "ms": None,
                                   "error": f"{type(err).__name__}: {err}"})
    path = results_io.write(result, args.out)
    print(f"wrote {path}")
    ok_rows = [r for r in result["rows"] if r.get("ms") is not None]
    if ok_rows:
        plot({**result, "rows": ok_rows}, path.with_suffix(".png"))
    print(f"{'T':>6} {'dispatch':>14} {'host us':>9} {'e2e us':>9} {'pipe us':>9} "
          f"{'kernel us':>9} {'overhead':>9}")
    for r in ok_rows:
        f = lambda x: f"{x:9.1f}" if isinstance(x, (int, float)) else f"{'-':>9}"  # noqa: E731
        print(f"{r['T']:>6} {r['dispatch']:>14} {f(r.get('us_host'))} {f(r['us_e2e'])} "
              f"{f(r['us_pipelined'])} {f(r.get('us_kernel'))} {f(r.get('us_overhead'))}")
    return 0 if len(ok_rows) == len(result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Single-GPU forward / forward+backward latency of every op (docs/design.md section 10).

Protocol: B=1, H=32, K=V=128, bf16 (gates fp32), T in {1K, 4K, 16K, 64K, 256K}; HGRN on
x, g [1, T, 4096].  Implementations:

* ``forge_dist`` -- the Triton kernels of :mod:`forge_dist.kernels`: ``auto`` (what the
  scheduler picks; ``scheduled`` / ``n_seg`` record it), ``fused`` and ``decoupled`` (every op
  but gated_delta_rule) forced; ``decoupled/nN`` rows sweep the segment count (``--sweep``).
  Backward runs the Triton backward kernels of every pattern (``kernels/*_backward.py``).
* ``ops`` -- the public functions (``forge_dist.ops.*``, what users call): argument checks,
  the plan cache for no-grad calls, the autograd runner otherwise; host overhead included,
  like FLA's rows.
* ``forge_dsl`` -- the same ops written as three callables (:mod:`forge_dist.dsl.builtins`):
  lowered onto the walker where the lowering applies, else the DSL executor (``lowered``).
* ``fla`` -- flash-linear-attention's chunk kernels (every import and call guarded).
* ``torch`` -- our PyTorch chunk form; ``torch_compile`` -- the same under torch.compile
  (both small T only).

``roofline_frac`` = bytes(q, k, v, gates read + o written) / ms, over the device-to-device
copy bandwidth measured in the same run.  Times: ``triton.testing.do_bench`` medians.

    python scaling_benchmarks/single_device.py [--ops simple_gla,gla] [--T 4096,65536]
        [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import registry, results_io  # noqa: E402

OPS = registry.NAMES
T_ALL = registry.SINGLE_DEVICE_T
SHAPE = registry.SINGLE_DEVICE
B, H, K, V, D_HGRN = SHAPE.B, SHAPE.H, SHAPE.K, SHAPE.V, SHAPE.D


def make_inputs(op, T, device, requires_grad=False):
    """Benchmark inputs (bf16 activations, fp32 log-decay gates; hgrn's gate bf16), drawn
    from a generator on ``device`` seeded with 0 (:func:`registry.make_inputs`)."""
    gen = torch.Generator(device=device).manual_seed(0)
    inp = registry.make_inputs(
        op, SHAPE, T, dtype=torch.bfloat16,
        randn=lambda *s: torch.randn(*s, device=device, generator=gen, dtype=torch.float32),
        rand=lambda *s: torch.rand(*s, device=device, generator=gen),
        channel_gate_offset=0.0, channel_gate_dtype=torch.bfloat16)
    if requires_grad:
        for t in inp.values():
            if t.is_floating_point():
                t.requires_grad_(True)
    return inp


def io_bytes(op, inp):
    """Bytes of the compulsory traffic: inputs read + o written (o in the input dtype)."""
    read = sum(t.numel() * t.element_size() for t in inp.values())
    first = inp["x"] if registry.spec(op).vector_state else inp["v"]
    return read + first.numel() * first.element_size()


def copy_bandwidth(device):
    """Device-to-device copy bandwidth (bytes/s): read + write of a 1 GiB buffer."""
    import triton.testing
    n = 1 << 28
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200)
    return 2 * n * 4 / (ms * 1e-3)


# ------------------------------------------------------------------------------------------
# implementations: each returns a callable running one pass, or raises to be skipped
# ------------------------------------------------------------------------------------------

def forge_fn(op, inp, execution):
    """``(run, info)``: one forward through the kernels; ``info()`` is the last schedule."""
    from forge_dist import kernels
    inputs = dict(inp)
    last = {}
    execution = None if execution == "auto" else execution.split("/")[0]

    def run():
        work = kernels.make_work(op, inputs, None, False,
                                 out_dtype=inp[registry.spec(op).first].dtype,
                                 execution=execution)
        o = work.finish(None)[0]
        last.update(scheduled=work.execution, n_seg=getattr(work, "n_seg", 1),
                    reason=getattr(work, "execution_reason", ""))
        return o
    return run, lambda: dict(last)


def ops_fn(op, inp):
    """The public op (``forge_dist.ops``): checks, plan cache (no-grad calls) or autograd
    runner, then the same kernels as the ``forge_dist`` rows."""
    from forge_dist import ops
    fn = getattr(ops, op)
    args = registry.call_args(op, inp)
    return lambda: fn(*args)[0]


def dsl_fn(op, inp):
    """The DSL re-expression of ``op`` and whether it was lowered onto a Triton template."""
    from forge_dist.dsl.builtins import BUILTINS
    var = BUILTINS[op]
    # the DSL takes one dtype for every input: gates go in as bf16 like q, k, v
    dt = inp[registry.spec(op).first].dtype
    args = [t.to(dt) for t in registry.call_args(op, inp)]
    return (lambda: var(*args)[0]), ("lowered" if var.lowering else "executor")


def fla_fn(op, inp):
    if op == "linear_attn":
        from fla.ops.linear_attn import chunk_linear_attn
        return lambda: chunk_linear_attn(inp["q"], inp["k"], inp["v"], normalize=False)[0]
    if op == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla
        return lambda: chunk_simple_gla(inp["q"], inp["k"], inp["v"], g=inp["g"])[0]
    if op == "gla":
        from fla.ops.gla import chunk_gla
        return lambda: chunk_gla(inp["q"], inp["k"], inp["v"], g=inp["g"])[0]
    if op == "gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return lambda: chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=inp["g"],
                                              beta=inp["beta"])[0]
    from fla.ops.hgrn import chunk_hgrn
    return lambda: chunk_hgrn(inp["x"], inp["g"])[0]


def torch_chunk(op):
    """The PyTorch chunk form of ``op`` as ``f(**inputs) -> o``."""
    from forge_dist.variants import decay_attention, delta_rule, vector_state

    def f(q=None, k=None, v=None, g=None, beta=None, x=None):
        if op == "hgrn":
            return vector_state.summarize(x, g, need_transition=False).o_zero
        scale = q.shape[-1] ** -0.5
        if op == "gated_delta_rule":
            return delta_rule.summarize(q, k, v, g, beta, scale, need_transition=False).o_zero
        return decay_attention.summarize(q, k, v, g, scale, need_transition=False).o_zero
    return f


def torch_fn(op, inp, compiled=False):
    f = torch_chunk(op)
    if compiled:
        f = torch.compile(f, dynamic=False)
    return lambda: f(**inp)


def with_backward(fn, inp):
    def run():
        for t in inp.values():
            t.grad = None
        o = fn()
        o.backward(torch.ones_like(o))
    return run


# ------------------------------------------------------------------------------------------

def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = sorted({r["op"] for r in result["rows"]}, key=OPS.index)
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(4.2 * max(1, len(ops)), 3.8),
                             squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in result["rows"] if r["op"] == op]
        keys = sorted({(r["impl"], r.get("strategy") or "", r["pass"]) for r in rows})
        for impl, strat, pas in keys:
            pts = sorted((r["T"], r["ms"]) for r in rows
                         if (r["impl"], r.get("strategy") or "", r["pass"]) == (impl, strat, pas))
            label = f"{impl}{'/' + strat if strat else ''} {pas}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if pas == "fwd" else "s--",
                    label=label, ms=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("T")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"single_device, {result['device']}, B=1 H=32 K=V=128 bf16")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--T", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--out", default=None, help="results folder (default scaling_benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="T in {4K, 64K}, fewer repetitions")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--max-bwd-T", type=int, default=16384,
                    help="largest T for the torch fwdbwd rows")
    ap.add_argument("--max-torch-T", type=int, default=1024)
    ap.add_argument("--plot", default=None, help="only redraw the PNG of this results JSON")
    ap.add_argument("--sweep", default="2,4,8,16,32,64",
                    help="segment counts for the decoupled sweep rows ('' to skip)")
    ap.add_argument("--sweep-ops", default="simple_gla,gla,hgrn")
    ap.add_argument("--sweep-T", default="4096,65536")
    ap.add_argument("--no-dsl", action="store_true", help="skip the forge_dsl rows")
    ap.add_argument("--impls", default=None,
                    help="only these, comma-separated: impl or impl/strategy "
                         "(e.g. forge_dist/auto,forge_dsl,fla)")
    ap.add_argument("--tag", default=None, help="suffix of the results file name")
    args = ap.parse_args(argv)

    if args.plot:
        res = results_io.load(args.plot)
        plot(res, Path(args.plot).with_suffix(".png"))
        print_table(res)
        return 0

    import triton.testing
    from tqdm import tqdm

    if not torch.cuda.is_available():
        print("single_device.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ops = [o for o in args.ops.split(",") if o]
    Ts = ([int(t) for t in args.T.split(",")] if args.T else
          ([4096, 65536] if args.quick else list(T_ALL)))
    passes = args.passes.split(",")
    rep = 30 if args.quick else 100

    try:
        import fla  # noqa: F401
        have_fla = True
    except Exception as e:  # noqa: BLE001
        have_fla = False
        print(f"fla unavailable: {e}", file=sys.stderr)

    result = results_io.header("single_device", {"B": B, "H": H, "K": K, "V": V,
                                                 "dtype": "bfloat16", "gates": "float32",
                                                 "hgrn_D": D_HGRN})
    if args.tag:
        result["tag"] = args.tag
    bw = copy_bandwidth(device)
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["notes"] = "forge_dist fwdbwd: Triton forward and Triton backward kernels"
    out_dir = Path(args.out) if args.out else None
    errors = []

    plan = []
    for op in ops:
        for T in Ts:
            for pas in passes:
                impls = [("forge_dist", "auto"), ("forge_dist", "fused")]
                if op != "gated_delta_rule":
                    impls.append(("forge_dist", "decoupled"))
                    if pas == "fwd" and op in args.sweep_ops.split(",") and \
                            str(T) in args.sweep_T.split(","):
                        impls += [("forge_dist", f"decoupled/n{n}")
                                  for n in args.sweep.split(",") if n]
                impls += [("ops", None), ("fla", None)]
                if pas == "fwd" and not args.no_dsl:  # every built-in lowers onto a template
                    impls.append(("forge_dsl", None))
                if T <= args.max_torch_T:
                    impls += [("torch", None), ("torch_compile", None)]
                for impl, strat in impls:
                    if pas == "fwdbwd" and impl in ("torch", "torch_compile") \
                            and T > args.max_bwd_T:
                        continue
                    if impl == "fla" and not have_fla:
                        continue
                    if impl == "torch_compile" and pas == "fwdbwd":
                        continue  # compile time dominates; the forward comparison suffices
                    plan.append((op, T, pas, impl, strat))
    if args.impls:
        keep = set(args.impls.split(","))
        plan = [p for p in plan if p[3] in keep or f"{p[3]}/{p[4]}" in keep]
    # slow-to-compile baselines last, so a time limit cuts them first
    order = {"forge_dist": 0, "ops": 0, "fla": 0, "forge_dsl": 1, "torch": 1,
             "torch_compile": 2}
    plan.sort(key=lambda p: (order[p[3]], p[2] != "fwd"))

    path = None
    for op, T, pas, impl, strat in tqdm(plan, desc="single_device", file=sys.stdout):
        try:
            inp = make_inputs(op, T, device, requires_grad=(pas == "fwdbwd"))
            info = None
            if strat and "/n" in strat:
                os.environ["FORGE_DIST_SEGMENTS"] = strat.split("/n")[1]
            else:
                os.environ.pop("FORGE_DIST_SEGMENTS", None)
            if impl == "forge_dist":
                fn, info = forge_fn(op, inp, strat)
            elif impl == "ops":
                fn = ops_fn(op, inp)
            elif impl == "forge_dsl":
                fn, strat = dsl_fn(op, inp)
            elif impl == "fla":
                fn = fla_fn(op, inp)
            else:
                fn = torch_fn(op, inp, compiled=(impl == "torch_compile"))
            if pas == "fwdbwd":
                fn = with_backward(fn, inp)
            with torch.no_grad() if pas == "fwd" else torch.enable_grad():
                fn()  # compile / autotune outside the timing
                torch.cuda.synchronize()
                ms, ms_min = triton.testing.do_bench(fn, warmup=10, rep=rep, quantiles=[0.5, 0.0])
            row = {"op": op, "T": T, "pass": pas, "impl": impl, "strategy": strat,
                   "ms": ms, "ms_min": ms_min}
            if pas == "fwd":
                row["roofline_frac"] = io_bytes(op, inp) / (ms * 1e-3) / bw
            if info is not None:
                row.update(info())
            result["rows"].append(row)
        except Exception as e:  # noqa: BLE001 - every impl is guarded; the failure is recorded
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            errors.append({"op": op, "T": T, "pass": pas, "impl": impl, "strategy": strat,
                           "error": msg})
            tqdm.write(f"[skip] {op} T={T} {pas} {impl}/{strat}: {msg}")
            if os.environ.get("FORGE_DIST_BENCH_TRACE"):
                traceback.print_exc()
        finally:
            os.environ.pop("FORGE_DIST_SEGMENTS", None)
            inp = fn = None
            torch.cuda.empty_cache()
        result["errors"] = errors
        path = results_io.write(result, out_dir)  # after every row: partial runs survive
    if path is not None:
        try:
            plot(result, path.with_suffix(".png"))
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e}", file=sys.stderr)
        print(f"wrote {path}")
        print_table(result)
    return 0


def print_table(result):
    """Per op, T and pass: the kernels (scheduler's choice), the public op, the DSL
    re-expression and FLA, with FLA's time over ours (kernels and public op) and the HBM
    roofline fraction of the kernels."""
    rows = result["rows"]
    keys = sorted({(r["op"], r["T"], r["pass"]) for r in rows},
                  key=lambda k: (OPS.index(k[0]), k[2], k[1]))
    print(f"{'op':18s} {'T':>7s} {'pass':7s} {'kernels':>8s} {'sched':>9s} {'ops':>8s} "
          f"{'dsl':>8s} {'fla':>8s} {'fla/kern':>8s} {'fla/ops':>8s} {'dsl/ops':>8s} "
          f"{'roofline':>8s}")
    for op, T, pas in keys:
        sel = [r for r in rows if (r["op"], r["T"], r["pass"]) == (op, T, pas)]
        get = lambda impl, s=None: next((r for r in sel if r["impl"] == impl  # noqa: E731
                                         and (s is None or r.get("strategy") == s)), None)
        a, po, fl, dsl = get("forge_dist", "auto"), get("ops"), get("fla"), get("forge_dsl")
        fmt = lambda r: f"{r['ms']:8.3f}" if r else f"{'-':>8s}"  # noqa: E731
        ratio = lambda x, y: f"{x['ms'] / y['ms']:8.2f}" if (x and y) else f"{'-':>8s}"  # noqa: E731
        sched = f"{a['scheduled'][:3]}/{a.get('n_seg', 1)}" if a and "scheduled" in a else "-"
        roof = f"{a['roofline_frac']:8.2f}" if a and "roofline_frac" in a else f"{'-':>8s}"
        print(f"{op:18s} {T:7d} {pas:7s} {fmt(a)} {sched:>9s} {fmt(po)} {fmt(dsl)} {fmt(fl)} "
              f"{ratio(fl, a)} {ratio(fl, po)} {ratio(dsl, po)} {roof}")

if __name__ == "__main__":
    sys.exit(main())

"""GLA (per-channel decay) backward: time, per-kernel split and accuracy of
:func:`forge_dist.kernels.vector_backward.vector_decay_backward`, against FLA.

Inputs as ``single_device.make_inputs("gla", T, ...)`` (B=1, H=32, K=V=128, bf16 q, k, v,
fp32 ``g = logsigmoid(randn + 4)``), ``do`` random bf16, no initial state nor final-state
gradient.  For each T (16K, 64K):

* ``bwd``: ``vector_decay_backward`` alone (``do_bench`` median) for the default tiles and a
  few alternatives (:data:`CONFIGS`), each checked against the same backward on fp32 copies
  (relative RMSE ``|a - b| / |b|`` of dq, dk, dv, dg), with its time per kernel
  (torch.profiler, a few calls);
* ``steep``: the default on gates whose chunks take the exact path (every channel -20..-34
  per token, ``all``; or 16 of 128 channels, ``mixed``), time and error against fp32;
* ``fwdbwd``: our public ``forge_dist.ops.gla`` forward+backward and FLA's ``chunk_gla``
  (if it imports), ``do_bench`` medians.

At T = 4096 the default bf16 and the fp32 backward are also checked against autograd of the
PyTorch chunk form in fp32 (``forge_dist.variants.decay_attention``).  A time budget
(``--budget``, seconds; an alarm interrupts the step running when it ends) skips what is
left, FLA last (its autotuning is slow); ``gla_bwd_probe.json`` goes to ``--out`` after
every step.

    python scaling_benchmarks/gla_bwd_probe.py --out DIR [--T 16384,65536] [--configs a,b]
    python scaling_benchmarks/gla_bwd_probe.py --smoke    # CPU, Triton interpreter, tiny
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

# name -> (BT, tiles): the default and alternatives worth comparing on a GPU.  Compiled for
# sm_90 (ptxas -v, as scaling_benchmarks/kernel_resources.py), bf16, K = V = 128: no spills
# in the walks and the fast kernel (w4_bks32: 16 bytes); the exact kernel, which does work
# only on steep gates, spills ~70-230 bytes outside its column loop
CONFIGS = {
    "default": (64, {}),
    "bks32": (64, {"dqk_BKS": 32}),
    "bv64": (64, {"dqk_BV": 64}),
    "bv16": (64, {"dqk_BV": 16}),
    "stages3": (64, {"dqk_stages": 3}),
    "w4_bks32": (64, {"dqk_warps": 4, "dqk_BKS": 32}),
    "walk_s3": (64, {"walk_stages": 3}),
    "unfused_bk64": (64, {"fuse_dv": False, "dqk_BK": 64, "dqk_BKS": 32, "dqk_warps": 4}),
    "bt32": (32, {}),
}
SMOKE_CONFIGS = {"default": (64, {}), "bt32_small": (32, {"dqk_BKS": 16, "walk_BK": 16}),
                 "unfused": (64, {"fuse_dv": False, "dqk_BK": 16})}


def rel(a, b) -> float:
    """Relative RMSE ``|a - b| / |b|`` in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make(T, device, dtype, *, B=1, H=32, K=128, V=128, gates="mild"):
    """``(q, k, v, g, do)``: single_device.make_inputs("gla") for the benchmark shape (the
    same generator and draws), else the same recipe at this shape; ``gates``: ``mild`` (as
    given), ``all`` (every channel -20..-34 per token) or ``mixed`` (channels K/2 .. K/2 + K/8,
    64..79 at K = 128, so)."""
    if (B, H, K, V) == (1, 32, 128, 128) and dtype == torch.bfloat16:
        from scaling_benchmarks.single_device import make_inputs

        inp = make_inputs("gla", T, device, requires_grad=True)
        q, k, v, g = (inp[n].detach() for n in ("q", "k", "v", "g"))
    else:
        gen = torch.Generator(device=device).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
        q, k, v = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, H, V).to(dtype)
        g = torch.nn.functional.logsigmoid(r(B, T, H, K) + 4)
    gen = torch.Generator(device=device).manual_seed(1)
    if gates != "mild":
        steep = g * 20 - 20
        if gates == "all":
            g = steep
        else:
            g = g.clone()
            c = slice(K // 2, K // 2 + max(K // 8, 1))
            g[..., c] = steep[..., c]
    do = torch.randn(v.shape, device=device, generator=gen).to(dtype)
    return q, k, v, g, do


def backward(x, BT=64, tiles=None):
    from forge_dist.kernels.vector_backward import vector_decay_backward

    q, k, v, g, do = x
    return vector_decay_backward(q, k, v, g, None, do, None, q.shape[-1] ** -0.5, BT=BT,
                                 tiles=tiles)[:4]


def errors(got, want) -> dict:
    return {n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg"), got, want)}


def bench(fn, smoke: bool) -> float:
    """Median ms: ``do_bench`` on a GPU; one timed call under the interpreter."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.5])


def kernel_split(fn, n=3) -> dict:
    """Mean CUDA time per kernel name over ``n`` calls (torch.profiler), us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:60]] = t / n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def chunk_form_grads(x):
    """fp32 autograd of the PyTorch chunk form: (dq, dk, dv, dg)."""
    from forge_dist.variants import decay_attention

    q, k, v, g, do = x
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, g)]
    o = decay_attention.summarize(*leaves, q.shape[-1] ** -0.5, need_transition=False).o_zero
    (o * do.float()).sum().backward()
    return [t.grad for t in leaves]


def _fwdbwd(op, x):
    """One forward + backward of ``op(q, k, v, g) -> (o, ...)`` with the output gradient."""
    q, k, v, g = (t.detach().requires_grad_(True) for t in x[:4])
    do = x[4]

    def run():
        for t in (q, k, v, g):
            t.grad = None
        op(q, k, v, g)[0].backward(do)
    return run


def fwdbwd_ours(x):
    from forge_dist import ops

    return _fwdbwd(ops.gla, x)


def fwdbwd_fla(x):
    from fla.ops.gla import chunk_gla

    return _fwdbwd(lambda q, k, v, g: chunk_gla(q, k, v, g=g), x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: not written)")
    ap.add_argument("--T", default="16384,65536")
    ap.add_argument("--configs", default=None, help="comma-separated names of CONFIGS")
    ap.add_argument("--budget", type=float, default=135.0,
                    help="seconds; the step running then is interrupted, the rest skipped")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, fp16")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("gla_bwd_probe.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    # the interpreter gets bf16 dots wrong (tests/kernels/test_vector_backward.py): fp16 there
    dtype = torch.float16 if smoke else torch.bfloat16
    shape = dict(B=1, H=2, K=32, V=32) if smoke else {}
    Ts = [128] if smoke else [int(t) for t in args.T.split(",")]
    configs = SMOKE_CONFIGS if smoke else CONFIGS
    if args.configs:
        configs = {n: configs[n] for n in args.configs.split(",")}

    result = results_io.header("gla_bwd_probe", {"T": Ts, "dtype": str(dtype), "shape": shape,
                                                 "configs": {n: [bt, t] for n, (bt, t) in
                                                             configs.items()},
                                                 "smoke": smoke})
    rows, skipped = result["rows"], []

    def left() -> float:
        return args.budget - (time.perf_counter() - t_start)

    def out_of_time(signum, frame):
        raise TimeoutError("time budget spent")

    signal.signal(signal.SIGALRM, out_of_time)  # no spin waits: one alarm for the budget
    signal.alarm(max(1, int(args.budget)))

    def save():
        result["skipped"] = skipped
        result["elapsed_s"] = time.perf_counter() - t_start
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            path = Path(args.out) / "gla_bwd_probe.json"
            path.write_text(json.dumps(result, indent=1) + "\n")

    def step(what, need_s, fn):
        if left() < need_s:
            skipped.append(what)
            print(f"[skip: budget] {what}", flush=True)
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed step is recorded, the rest goes on
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rows.append({"what": what, "error": msg})
            print(f"[error] {what}: {msg}", flush=True)
        finally:
            if not smoke:
                torch.cuda.empty_cache()
            save()

    def run_steps():
        # accuracy against the PyTorch chunk form (independent of the kernels), small T
        T_ref = 64 if smoke else 4096

        def ref_check():
            x = make(T_ref, device, dtype, **shape)
            want = chunk_form_grads(x)
            x32 = [t.float() for t in x]
            for name, xx in (("default", x), ("fp32", x32)):
                err = errors(backward(xx), want)
                rows.append({"what": "vs_chunk_form", "T": T_ref, "config": name, "err": err})
                print(f"T={T_ref} {name:>12s} vs chunk form: "
                      + " ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
        step("vs_chunk_form", 20, ref_check)

        for T in Ts:
            data = {}

            def inputs(T=T):
                data["x"] = make(T, device, dtype, **shape)
                data["want"] = backward([t.float() for t in data["x"]])
            step(f"inputs T={T}", 10, inputs)
            if "want" not in data:
                continue
            x, want = data["x"], data["want"]

            for name, (BT, tiles) in configs.items():
                def one(name=name, BT=BT, tiles=tiles):
                    err = errors(backward(x, BT, tiles), want)  # also compiles
                    ms = bench(lambda: backward(x, BT, tiles), smoke)
                    try:
                        ks = {} if smoke else kernel_split(lambda: backward(x, BT, tiles))
                    except (RuntimeError, AttributeError) as e:  # the split is optional
                        ks = {"error": str(e)[:200]}
                    rows.append({"what": "bwd", "T": T, "config": name, "BT": BT, "tiles": tiles,
                                 "ms": ms, "err": err, "kernels_us": ks})
                    print(f"T={T:6d} bwd {name:>12s} {ms:8.3f} ms  "
                          + " ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
                    if ks and "error" not in ks:
                        print("        kernels (us): " + ", ".join(
                            f"{k.split('(')[0]} {v:.0f}" for k, v in ks.items()), flush=True)
                step(f"bwd T={T} {name}", 8, one)

            if T == Ts[0]:
                for gates in ("all", "mixed"):
                    def steep(gates=gates):
                        xs = make(T, device, dtype, gates=gates, **shape)
                        err = errors(backward(xs), backward([t.float() for t in xs]))
                        ms = bench(lambda: backward(xs), smoke)
                        rows.append({"what": "steep", "T": T, "gates": gates, "ms": ms,
                                     "err": err})
                        print(f"T={T:6d} steep gates ({gates}) {ms:8.3f} ms  "
                              + " ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
                    step(f"steep T={T} {gates}", 15, steep)

            if not smoke:
                def ours():
                    ms = bench(fwdbwd_ours(x), smoke)
                    rows.append({"what": "fwdbwd", "T": T, "impl": "forge_dist ops.gla", "ms": ms})
                    print(f"T={T:6d} fwd+bwd ops.gla {ms:8.3f} ms", flush=True)
                step(f"fwdbwd ours T={T}", 15, ours)
            x = want = data = None

        if not smoke and not args.no_fla:
            for T in Ts:
                def fla(T=T):
                    x = make(T, device, dtype)
                    run = fwdbwd_fla(x)
                    run()  # autotune outside the timing
                    ms = bench(run, smoke)
                    rows.append({"what": "fwdbwd", "T": T, "impl": "fla chunk_gla", "ms": ms})
                    print(f"T={T:6d} fwd+bwd fla.chunk_gla {ms:8.3f} ms", flush=True)
                step(f"fwdbwd fla T={T}", 45 if T == Ts[0] else 15, fla)


    try:
        run_steps()
    except TimeoutError:  # the alarm between steps
        skipped.append("the rest (budget)")
    signal.alarm(0)
    print_table(result)
    save()
    if args.out:
        print(f"wrote {Path(args.out) / 'gla_bwd_probe.json'}")
    return 0


def print_table(result) -> None:
    rows = result["rows"]
    print("\n config          T   bwd ms    dq err   dk err   dv err   dg err")
    for r in rows:
        if r.get("what") == "bwd":
            e = r["err"]
            print(f" {r['config']:<12s} {r['T']:6d} {r['ms']:8.3f}  {e['dq']:.1e}  {e['dk']:.1e}"
                  f"  {e['dv']:.1e}  {e['dg']:.1e}")
    for r in rows:
        if r.get("what") == "fwdbwd":
            print(f" fwd+bwd {r['impl']:<20s} T={r['T']:6d} {r['ms']:8.3f} ms")
    if result.get("skipped"):
        print(" skipped (budget):", ", ".join(result["skipped"]))


if __name__ == "__main__":
    sys.exit(main())

"""Session 24 probes (scratch, not shipped).

part "map": why a walk with fused prologues costs ~2x the plain walk (issue 7).
part "host": where the static plan's ~24 us of host overhead goes (issue 8).
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
OUT = Path(os.environ.get("OUT", "out"))


@triton.jit
def elu1(x):
    x = x.to(tl.float32)
    return tl.where(x > 0.0, x, tl.exp(x) - 1.0) + 1.0


@triton.jit
def ident(x):
    return x.to(tl.float32)


def bench(fn, reps=30):
    return triton.testing.do_bench(fn, warmup=10, rep=reps) * 1e3  # us


def part_map(res):
    from forge_dist.kernels import _common, scalar, scheduler
    B, H, K, V = 1, 32, 128, 128
    for T in (16384, 65536):
        q, k, v = (torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        base = scalar.fused_config(K, V)
        sched = scheduler.schedule(B, T, H, K, V, base["BT"], min(base["BV"], 128))
        for maps_name, maps in (("none", None), ("ident_qk", {"q": ident, "k": ident}),
                                ("elu_qk", {"q": elu1, "k": elu1}), ("elu_q", {"q": elu1}),
                                ("elu_k", {"k": elu1})):
            for nw in (4, 8):
                for ns in (1, 2, 3):
                    cfg = dict(base, num_warps=nw, num_stages=ns, tune=False)
                    try:
                        fn = lambda: _common.walk(k, v, q=q, cfg=cfg, prec="tf32x3", scale=0.1,
                                                  out_dtype=torch.bfloat16, n_seg=sched.n_seg,
                                                  maps=maps)
                        fn()
                        us = bench(fn)
                    except Exception as e:  # noqa: BLE001
                        us = f"{type(e).__name__}: {str(e)[:200]}"
                    row = dict(T=T, maps=maps_name, nw=nw, ns=ns, n_seg=sched.n_seg, us=us,
                               base=(nw == base["num_warps"] and ns == base["num_stages"]))
                    print(row, flush=True)
                    res["map"].append(row)
        # the pre-mapped pass a PyTorch prologue costs (elu + 1 on q and k)
        fn = lambda: (torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1)
        res["map"].append(dict(T=T, maps="torch_prologue_qk", us=bench(fn)))
        print(res["map"][-1], flush=True)


def _e2e(fn, iters=300):
    host, e2e = [], []
    for _ in range(20):
        fn()
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        e2e.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(e2e)


def _events(fn, iters=200):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def part_host(res):
    from forge_dist.runtime import aot, plan
    from forge_dist.runtime.dispatcher import CtypesDriver, Dispatcher
    B, H, K, V, T = 1, 32, 128, 128, 1024
    dev = torch.device("cuda", 0)
    cache_dir = Path("/tmp/aot_probe")
    cfg = dict(variants=["simple_gla"], heads=[H], head_dims=[[K, V]], dtypes=["bfloat16"],
               execution=["decoupled"], initial_state=[False], sequence_parallel=False)
    aot.compile_all(cfg, target="cuda:90", cache_dir=cache_dir)
    cache = aot.CubinCache(cache_dir, "cuda:90")
    q, k, v = (torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4)
    pl = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device=dev,
              execution="decoupled", backend="static", dispatcher=Dispatcher(cache, CtypesDriver()))
    print(pl.describe()["launches"], flush=True)
    out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)
    bound = pl.bind(q, k, v, g, out=out)
    stream = pl.finish_exec.stream()
    raw = [(launch, (*head, stream, pack.params_address)) for launch, head, pack in bound._steps]
    rows = {}

    def raw_n(n):
        def f():
            for launch, a in raw[:n]:
                launch(*a)
        return f
    for n in (1, 2, 3):
        f = raw_n(n)
        h, e = _e2e(f)
        kern = _events(f)
        rows[f"raw_{n}"] = dict(host=h, e2e=e, kernel=kern, overhead=e - kern)
    # one launch of a trivial kernel: what any Python-issued launch costs end to end
    x = torch.zeros(1, device=dev)
    f = lambda: x.add_(1)  # noqa: E731
    h, e = _e2e(f)
    rows["torch_add_1elem"] = dict(host=h, e2e=e, kernel=_events(f))
    f = lambda: torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)  # noqa: E731
    rows["empty"] = dict(host=_e2e(f)[0])
    # run() without its launches: the Python prelude
    real = pl.finish_exec
    pl.finish_exec = lambda tensors: None
    rows["run_prelude"] = dict(host=_e2e(lambda: pl.run(q, k, v, g))[0])
    rows["run_prelude_out"] = dict(host=_e2e(lambda: pl.run(q, k, v, g, out=out))[0])
    pl.finish_exec = real
    h, e = _e2e(lambda: pl.run(q, k, v, g))
    rows["run"] = dict(host=h, e2e=e, overhead=e - rows["raw_3"]["kernel"])
    # the pieces of the prelude
    names = pl.input_names
    shapes, dtypes = pl.shapes, pl.dtypes
    ins = (q, k, v, g)

    def checks():
        for n, t in zip(names, ins):
            if not (isinstance(t, torch.Tensor) and t.shape == shapes[n] and t.dtype == dtypes[n]
                    and t.device == dev and t.is_contiguous() and not (t.data_ptr() % 16)):
                raise RuntimeError
    rows["checks4"] = dict(host=_e2e(checks)[0])
    rows["grad_check"] = dict(host=_e2e(lambda: pl._check_state_and_grad(ins, None))[0])
    res["host"] = rows
    for k_, v_ in rows.items():
        print(k_, {a: round(b, 2) for a, b in v_.items()}, flush=True)


def part_gates(res):
    from forge_dist.kernels import _common, scalar, scheduler
    B, H, K, V = 1, 32, 128, 128
    rows = res.setdefault("gates", [])
    for T in (1024, 2048, 4096, 8192, 16384, 65536, 262144):
        q, k, v = (torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda") + 4)
        cfg = dict(scalar.fused_config(K, V), tune=False)
        sched = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], 128))
        for raw in (False, True):
            fn = lambda: _common.walk(k, v, q=q, g=g, gate=1, cfg=cfg, prec="tf32x3", scale=0.1,
                                      out_dtype=torch.bfloat16, n_seg=sched.n_seg, raw_gates=raw)
            a = fn()
            row = dict(T=T, raw=raw, n_seg=sched.n_seg, us=bench(fn, 50))
            if raw:
                row["max_diff"] = max((x.float() - y.float()).abs().max().item()
                                      for x, y in zip(a, ref))
            else:
                ref = a
            print(row, flush=True)
            rows.append(row)


@triton.jit
def map_kernel(x, y, N, MAP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(y + o, MAP(tl.load(x + o, mask=m, other=0.0)).to(y.dtype.element_ty), mask=m)


def part_ew(res):
    rows = res.setdefault("ew", [])
    for T in (16384, 65536):
        q, k = (torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for BLOCK, nw in ((1024, 4), (4096, 4), (4096, 8), (8192, 8)):
            def fn():
                outs = []
                for x in (q, k):
                    y = torch.empty_like(x)
                    map_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), MAP=elu1,
                                                                  BLOCK=BLOCK, num_warps=nw)
                    outs.append(y)
                return outs
            y = fn()
            err = (y[0].float() - (torch.nn.functional.elu(q.float()) + 1)).abs().max().item()
            row = dict(T=T, BLOCK=BLOCK, nw=nw, us=bench(fn, 50), err=err)
            print(row, flush=True)
            rows.append(row)


def part_apply(res):
    import cProfile, pstats, io
    import torch.fx as fx
    import torch.nn.functional as F
    from forge_dist.dsl import codegen
    from forge_dist.kernels import prologue
    gm = fx.symbolic_trace(lambda x: F.elu(x) + 1.0)
    chain = [n for n in gm.graph.nodes if n.op != "output"]
    fmap, fgrad = codegen.triton_map(chain)[0], codegen.triton_map_grad(chain)[0]
    rows = res.setdefault("apply", [])
    for T in (4096, 65536):
        q = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16)
        cands = {
            "apply_map": lambda: prologue.apply_map(q, fmap, fgrad),
            "probe_kernel": lambda: map_kernel[(triton.cdiv(q.numel(), 1024),)](
                q, torch.empty_like(q), q.numel(), MAP=elu1, BLOCK=1024, num_warps=4),
            "probe_kernel_genmap": lambda: map_kernel[(triton.cdiv(q.numel(), 1024),)](
                q, torch.empty_like(q), q.numel(), MAP=fmap, BLOCK=1024, num_warps=4),
            "direct_prologue_kernel": lambda: prologue._map_kernel[(triton.cdiv(q.numel(), 1024),)](
                q, torch.empty_like(q), q.numel(), fmap, BLOCK=1024, num_warps=4),
            "torch": lambda: F.elu(q) + 1.0,
        }
        for name, fn in cands.items():
            fn(); torch.cuda.synchronize()
            us = bench(fn, 50)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            host = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            row = dict(T=T, impl=name, us=us, host_us=host)
            print(row, flush=True)
            rows.append(row)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(20):
            cands["apply_map"]()
        pr.disable(); torch.cuda.synchronize()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(12)
        print(sio.getvalue()[:3000], flush=True)


if __name__ == "__main__":
    res = {"map": [], "host": {}, "device": torch.cuda.get_device_name()}
    for part in sys.argv[1:]:
        try:
            {"map": part_map, "host": part_host, "gates": part_gates, "ew": part_ew, "apply": part_apply}[part](res)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res[f"{part}_error"] = repr(e)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "probe_s24.json").write_text(json.dumps(res, indent=1, default=str))

"""Where the time of one op call goes: GPU time per kernel (torch.profiler), ours and FLA's.

For each op, T and pass (``fwd``, ``fwdbwd``) the call runs ``--iters`` times under
``torch.profiler``; every CUDA kernel's device time is summed by name and divided by the
iteration count, giving microseconds per call.  Same inputs as ``single_device.py``
(B=1, H=32, K=V=128, bf16, fp32 gates; hgrn on ``[1, T, 4096]``).

``--sweep hgrn,gated_delta_rule,simple_gla`` also times tile configurations (the evidence
behind the defaults in ``kernels/*.py``): hgrn's forward and backward over (BT, BD, warps)
and segment counts; gated_delta_rule's forward over the WY kernel's and the walker's tiles;
the scalar-decay walker's V tile and warps (simple_gla forward); ``gate_sum``: simple_gla's
walks summing the gates themselves against a gate-sum launch before them; ``segments``: the
scalar-decay forward walks over segment counts (1 = fused); ``summary``: at B=4 (``--sweep-B``),
simple_gla's summary walk (k and v only, what a rank before the last streams before its
output walk) over its V tile, warps and stages, with the bandwidth it reaches on k and v
beside the output walk's and a device copy's.

    python scaling_benchmarks/kernel_profile.py --ops gla,hgrn --T 16384 [--sweep hgrn]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402
from scaling_benchmarks.single_device import (copy_bandwidth, fla_fn,  # noqa: E402
                                              forge_fn, make_inputs, ops_fn,
                                              with_backward)


def kernel_times(fn, iters: int) -> dict:
    """``{kernel name: microseconds per call}`` of ``fn`` (already warmed up)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            per[ev.key[:120]] += t / iters
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def host_profile(fn, iters: int, top: int = 25) -> dict:
    """Where the host time of one call goes: wall time per call (``iters`` calls then one
    synchronisation: when the host is the bottleneck this is the host time), and cProfile's
    functions by own time, microseconds per call."""
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(((f"{Path(f).name}:{ln}:{name}", nc / iters, tt / iters * 1e6,
                    ct / iters * 1e6) for (f, ln, name), (cc, nc, tt, ct, _) in stats.items()),
                  key=lambda r: -r[2])
    return {"wall_us": wall,
            "functions": [{"function": n, "calls": c, "own_us": t, "cumulative_us": cu}
                          for n, c, t, cu in rows[:top]]}


def _bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=30)


def config_sweep(op: str, T: int, device) -> list:
    """Forward times of ``op`` (the ``forge_dist`` auto path) over the configs of its
    kernels; each row names the config dict it changed and the values."""
    from forge_dist.kernels import delta, scalar, vector

    walker = [dict(BT=bt, BV=bv, num_warps=nw, num_stages=ns)
              for bt, bv, nw, ns in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4),
                                     (64, 32, 4, 2), (64, 32, 4, 3), (64, 128, 8, 2),
                                     (64, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 2),
                                     (32, 64, 4, 3), (32, 128, 8, 2))]
    if op == "gla":  # the walker's tiles and pipeline; the gate kernel's slice and warps
        trials = [("FUSED_CONFIG", c) for c in walker]
        trials += [("GATE_CONFIG", dict(BKS=bks, num_warps=nw, num_stages=ns))
                   for bks, nw, ns in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (64, 4, 3))]
        mod = vector
    elif op == "gated_delta_rule":  # the walker (the WY kernel's designs: docs/performance.md)
        trials = [("FUSED_CONFIG", dict(BV=bv, num_warps=nw, num_stages=ns))
                  for bv, nw, ns in ((32, 4, 2), (32, 4, 1), (32, 4, 3), (32, 4, 4),
                                     (32, 8, 2), (32, 8, 3), (16, 4, 3), (16, 4, 4),
                                     (16, 4, 2), (16, 2, 2), (16, 2, 3), (64, 4, 3),
                                     (64, 8, 3))]
        mod = delta
    else:  # linear_attn / simple_gla: the scalar walker
        trials = [("FUSED_CONFIG", c) for c in walker]
        mod = scalar
    inp = make_inputs(op, T, device)
    rows = []
    stages = getattr(mod, "LOW_PRECISION_STAGES", None)  # overrides FUSED_CONFIG's for bf16
    for name, change in trials:
        cfg = getattr(mod, name)
        saved = dict(cfg)
        cfg.update(change)
        if stages is not None and "num_stages" in change:
            mod.LOW_PRECISION_STAGES = change["num_stages"]
        row = {"op": op, "T": T, "config": name, **change}
        try:
            with torch.no_grad():
                row["fwd_ms"] = _bench(forge_fn(op, inp, "auto")[0])
        except Exception as e:  # noqa: BLE001 - a config that fails is recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            cfg.clear()
            cfg.update(saved)
            if stages is not None:
                mod.LOW_PRECISION_STAGES = stages
        print(row, flush=True)
        rows.append(row)
    return rows


def gate_sum_sweep(T: int, device, iters: int = 20) -> list:
    """simple_gla's forward walks (the scheduler's segments) with the scalar gates summed in
    the walks (``raw_gates``) against a gate-sum launch before them: GPU time per call of
    every kernel (profiler), the evidence behind ``walker.SUM_GATES_IN_WALK_MAX_TOKENS``."""
    from forge_dist.kernels import compat, scalar, scheduler, walker

    inp = make_inputs("simple_gla", T, device)
    q, k, v, g = inp["q"], inp["k"], inp["v"], inp["g"]
    B, _, H, K = q.shape
    V = v.shape[-1]
    cfg = dict(scalar.fused_config(K, V), tune=False)
    sched = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], V))
    rows, ref = [], None
    for raw in (False, True):
        fn = lambda: walker.walk(k, v, q=q, g=g, gate=1, cfg=cfg, scale=K ** -0.5,  # noqa: E731
                                 prec=compat.dot_precision(q.dtype), n_seg=sched.n_seg,
                                 out_dtype=q.dtype, raw_gates=raw)
        with torch.no_grad():
            out = fn()
            per = kernel_times(fn, iters)
        row = {"op": "simple_gla", "T": T, "raw_gates": raw, "n_seg": sched.n_seg,
               "launches": len(per), "kernels_us": per, "fwd_ms": sum(per.values()) / 1e3}
        if ref is None:
            ref = out
        else:  # same walks, the gate sums formed in another kernel: equal to rounding
            row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                      for a, b in zip(out, ref))
        print(row, flush=True)
        rows.append(row)
    return rows


def segments_sweep(T: int, device, iters: int = 20, counts=(1, 2, 4, 8, 16)) -> list:
    """linear_attn's and simple_gla's forward walks over segment counts (1: FUSED, one
    launch; more: DECOUPLED, summaries then outputs): GPU time of every kernel (profiler)
    and ``do_bench``'s time of the whole call, beside the scheduler's choice."""
    from forge_dist.kernels import compat, scalar, scheduler, walker

    rows = []
    for op in ("linear_attn", "simple_gla"):
        inp = make_inputs(op, T, device)
        q, k, v, g = inp["q"], inp["k"], inp["v"], inp.get("g")
        B, _, H, K = q.shape
        V = v.shape[-1]
        cfg = dict(scalar.fused_config(K, V), tune=False)
        sched = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], V))
        for n in counts:
            if n > 1 and T // n < cfg["BT"] * scheduler.MIN_CHUNKS_PER_SEGMENT:
                continue
            fn = lambda: walker.walk(k, v, q=q, g=g, gate=0 if g is None else 1,  # noqa: E731
                                     cfg=cfg, scale=K ** -0.5,
                                     prec=compat.dot_precision(q.dtype), n_seg=n,
                                     out_dtype=q.dtype)
            with torch.no_grad():
                fn()
                per = kernel_times(fn, iters)
                wall = _bench(fn)
            row = {"op": op, "T": T, "n_seg": n, "scheduled_n_seg": sched.n_seg,
                   "kernels_us": per, "gpu_us": sum(per.values()), "fwd_ms": wall}
            print(row, flush=True)
            rows.append(row)
    return rows


SUMMARY_TILES = ((64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 8, 2), (64, 4, 3), (64, 4, 4),
                 (128, 4, 2), (128, 8, 2), (128, 8, 3), (128, 4, 3))


def summary_sweep(T: int, device, B: int = 4, tiles=SUMMARY_TILES, n_seg: int = 1) -> list:
    """simple_gla's summary walk (the shard's end state from k, v and the gates' chunk sums,
    no q and no outputs) at ``B, T``, H=32, K=V=128 bf16, over ``(BV, warps, stages)``, in
    ``n_seg`` segments walked in parallel (more than one: the one-GPU decoupled schedule's
    summaries): ``do_bench`` medians and the bandwidth on k and v (bytes of k and v over the
    time); first rows: the default output walk (q, k, v read, o written) and a device copy."""
    from forge_dist.kernels import compat, scalar, walker
    from forge_dist.kernels.walker_launches import segment_length

    H, K, V = 32, 128, 128
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, d).to(torch.bfloat16) for d in (K, K, V))
    g = torch.nn.functional.logsigmoid(r(B, T, H)) / 16
    base = dict(scalar.fused_config(K, V), tune=False)
    g_cum = walker.chunk_gate_cumsum(g, base["BT"])
    prec = compat.dot_precision(k.dtype)
    kv = 2 * k.numel() * k.element_size()
    rows = [{"kind": "device copy", "TBps": copy_bandwidth(device) / 1e12}]
    with torch.no_grad():
        ms = _bench(lambda: walker.walk(k, v, q=q, g=g, gate=1, g_cum=g_cum, cfg=base,
                                        scale=K ** -0.5, prec=prec, out_dtype=k.dtype))
    rows.append({"kind": "output walk", "B": B, "T": T, **{n: base[n] for n in
                 ("BV", "num_warps", "num_stages")}, "ms": ms, "TBps": 2 * kv / ms / 1e9})
    seg = segment_length(T, base["BT"], n_seg)
    n_seg = -(-T // seg)
    hs = torch.empty(n_seg, B, H, K, V, dtype=torch.float32, device=device)
    gt = torch.empty(n_seg, B, H, K, dtype=torch.float32, device=device)
    ref = None
    for bv, nw, ns in tiles:
        # (a walk without outputs reads the summary_* tiles where the config has them)
        cfg = dict(base, BV=bv, num_warps=nw, num_stages=ns, summary_BV=bv, summary_warps=nw,
                   summary_stages=ns)
        row = {"kind": "summary walk", "B": B, "T": T, "n_seg": n_seg, "BV": bv,
               "num_warps": nw, "num_stages": ns}
        fn = lambda: walker._launch_walk(n_seg, seg, q=None, k=k, v=v, g=g_cum, gate=1, w=None,  # noqa: E731
                                         h0=None, o=None, ht=hs, gt=gt, store_ht=True,
                                         scale=1.0, V=V, cfg=cfg, prec=prec)
        try:
            row["ms"] = _bench(fn)
            row["TBps"] = kv / row["ms"] / 1e9
            if ref is None:
                ref = hs.clone()
            else:  # the same state from every tiling, to rounding
                row["max_rel_diff"] = ((hs - ref).abs().max() / ref.abs().max()).item()
        except Exception as e:  # noqa: BLE001 - a config that fails is recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(row, flush=True)
        rows.append(row)
    return rows


HGRN_TILES = ((64, 32), (32, 64), (64, 64), (128, 32), (32, 128), (64, 128))


def hgrn_sweep(T: int, device, configs=None, segments=(4, 16, 64, 256),
               backward: bool = True) -> list:
    """hgrn forward/backward times over tiles and segment counts (``do_bench`` medians);
    ``configs``: ``(BT, BD, num_warps[, num_stages])`` (default: ``HGRN_TILES`` x 4, 8 warps,
    the configured stages)."""
    from forge_dist.kernels import vector_state as vs

    inp = make_inputs("hgrn", T, device)
    x, g = inp["x"], inp["g"]
    do = torch.randn_like(x)
    rows = []
    base_f, base_b = dict(vs.FUSED_CONFIG), dict(vs.BWD_CONFIG)
    try:
        for cfg in configs or [(bt, bd, nw) for bt, bd in HGRN_TILES for nw in (4, 8)]:
            bt, bd, nw = cfg[:3]
            ns = cfg[3] if len(cfg) > 3 else base_f["num_stages"]
            for n_seg in segments:
                vs.FUSED_CONFIG.update(BT=bt, BD=bd, num_warps=nw, num_stages=ns)
                vs.BWD_CONFIG.update(BT=bt, BD=bd, num_warps=nw, num_stages=ns)
                row = {"BT": bt, "BD": bd, "num_warps": nw, "num_stages": ns, "n_seg": n_seg}
                try:
                    f = lambda: vs.hgrn_forward(x, g, None, out_dtype=x.dtype,  # noqa: E731
                                                n_seg=n_seg)
                    b = lambda: vs.hgrn_backward(x, g, None, do, None,  # noqa: E731
                                                 n_seg=n_seg, dg_dtype=g.dtype)
                    row["fwd_ms"] = _bench(f)
                    if backward:
                        row["bwd_ms"] = _bench(b)
                except Exception as e:  # noqa: BLE001 - a config that fails is recorded
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(row, flush=True)
                rows.append(row)
    finally:
        vs.FUSED_CONFIG.clear(), vs.FUSED_CONFIG.update(base_f)
        vs.BWD_CONFIG.clear(), vs.BWD_CONFIG.update(base_b)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="gla,hgrn,gated_delta_rule")
    ap.add_argument("--T", default="16384")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--impls", default="forge_dist,fla",
                    help="forge_dist (the kernels' work objects), ops (the public ops), fla")
    ap.add_argument("--host", action="store_true",
                    help="also profile the host side of each call (cProfile, wall time)")
    ap.add_argument("--sweep", default="", help="ops whose kernel configs to sweep "
                    "(gate_sum: simple_gla's walks with and without the gate-sum launch)")
    ap.add_argument("--sweep-T", default="65536", help="comma-separated")
    ap.add_argument("--sweep-B", type=int, default=4, help="batch of the summary sweep")
    ap.add_argument("--sweep-segments", type=int, default=1,
                    help="segments of the summary sweep's walk (the one-GPU decoupled "
                         "schedule's summaries: more than one)")
    ap.add_argument("--summary-tiles", default="",
                    help="summary sweep tiles as BVxWARPSxSTAGES,... (default: the built-in grid)")
    ap.add_argument("--hgrn-configs", default="",
                    help="hgrn sweep tiles as BTxBDxWARPS[xSTAGES],... (default: the built-in grid)")
    ap.add_argument("--hgrn-segments", default="4,16,64,256")
    ap.add_argument("--hgrn-no-bwd", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = results_io.header("kernel_profile", {"B": 1, "H": 32, "K": 128, "V": 128,
                                                  "dtype": "bfloat16", "iters": args.iters})
    for op in args.ops.split(","):
        for T in (int(t) for t in args.T.split(",")):
            for pas in args.passes.split(","):
                impls = [i for i in args.impls.split(",") if not (args.no_fla and i == "fla")]
                for impl in impls:
                    inp = make_inputs(op, T, device, requires_grad=(pas == "fwdbwd"))
                    try:
                        fn = {"forge_dist": lambda: forge_fn(op, inp, "auto")[0],
                              "ops": lambda: ops_fn(op, inp),
                              "fla": lambda: fla_fn(op, inp)}[impl]()
                        if pas == "fwdbwd":
                            fn = with_backward(fn, inp)
                        with torch.no_grad() if pas == "fwd" else torch.enable_grad():
                            fn()
                            fn()
                            per = kernel_times(fn, args.iters)
                            host = host_profile(fn, max(args.iters, 20)) if args.host else None
                    except Exception as e:  # noqa: BLE001 - FLA refuses some backwards
                        print(f"[skip] {op} {T} {pas} {impl}: {str(e)[:160]}", flush=True)
                        continue
                    total = sum(per.values())
                    print(f"\n{op} T={T} {pas} {impl}: {total / 1e3:.3f} ms of kernels")
                    for name, us in per.items():
                        print(f"  {us:10.1f} us  {100 * us / total:5.1f}%  {name}")
                    row = {"op": op, "T": T, "pass": pas, "impl": impl, "total_us": total,
                           "kernels_us": per}
                    if host is not None:
                        print(f"  host: {host['wall_us']:.1f} us per call (wall, synchronised "
                              f"after {max(args.iters, 20)} calls); own time by function:")
                        for f in host["functions"][:15]:
                            print(f"  {f['own_us']:10.1f} us  x{f['calls']:<6.1f} "
                                  f"{f['function']}")
                        row["host"] = host
                    result["rows"].append(row)
                    inp = fn = None
                    torch.cuda.empty_cache()
    if args.tag:
        result["benchmark"] = f"kernel_profile_{args.tag}"
    result["sweeps"] = []
    for op, sweep_T in ((o, int(t)) for o in args.sweep.split(",") if o
                        for t in args.sweep_T.split(",")):
        hcfg = [tuple(int(x) for x in c.split("x")) for c in args.hgrn_configs.split(",") if c]
        if op == "hgrn":
            rows = hgrn_sweep(sweep_T, device, hcfg or None,
                              [int(n) for n in args.hgrn_segments.split(",")],
                              backward=not args.hgrn_no_bwd)
        elif op == "gate_sum":
            rows = gate_sum_sweep(sweep_T, device)
        elif op == "segments":
            rows = segments_sweep(sweep_T, device)
        elif op == "summary":
            tiles = [tuple(int(x) for x in c.split("x")) for c in args.summary_tiles.split(",")
                     if c] or SUMMARY_TILES
            rows = summary_sweep(sweep_T, device, args.sweep_B, tiles, n_seg=args.sweep_segments)
        else:
            rows = config_sweep(op, sweep_T, device)
        result["sweeps"].append({"op": op, "T": sweep_T, "rows": rows})
        results_io.write(result, Path(args.out) if args.out else None)  # a time limit keeps it
    print(f"wrote {results_io.write(result, Path(args.out) if args.out else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

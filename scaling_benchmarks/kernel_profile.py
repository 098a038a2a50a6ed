"""Where the time of one op call goes: GPU time per kernel (torch.profiler), ours and FLA's.

For each op, T and pass (``fwd``, ``fwdbwd``) the call runs ``--iters`` times under
``torch.profiler``; every CUDA kernel's device time is summed by name and divided by the
iteration count, giving microseconds per call.  Same inputs as ``single_device.py``
(B=1, H=32, K=V=128, bf16, fp32 gates; hgrn on ``[1, T, 4096]``).

``--hgrn-sweep`` also times hgrn's forward and backward kernels over tile shapes
(BT, BD, warps) and segment counts, the evidence behind ``vector_state``'s defaults.

    python scaling_benchmarks/kernel_profile.py --ops gla,hgrn --T 16384 [--hgrn-sweep]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402
from scaling_benchmarks.single_device import (fla_fn, forge_fn, make_inputs,  # noqa: E402
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


def hgrn_sweep(T: int, device) -> list:
    """hgrn forward/backward times over tiles and segment counts (``do_bench`` medians)."""
    import triton.testing

    from forge_dist.kernels import vector_state as vs

    inp = make_inputs("hgrn", T, device)
    x, g = inp["x"], inp["g"]
    do = torch.randn_like(x)
    rows = []
    base_f, base_b = dict(vs.FUSED_CONFIG), dict(vs.BWD_CONFIG)
    try:
        for bt in (32, 64, 128):
            for bd in (32, 64, 128):
                if bt * bd > 8192:
                    continue
                for nw in (4, 8):
                    for n_seg in (4, 16, 64, 256):
                        vs.FUSED_CONFIG.update(BT=bt, BD=bd, num_warps=nw)
                        vs.BWD_CONFIG.update(BT=bt, BD=bd, num_warps=nw)
                        row = {"BT": bt, "BD": bd, "num_warps": nw, "n_seg": n_seg}
                        try:
                            f = lambda: vs.hgrn_forward(x, g, None, out_dtype=x.dtype,  # noqa: E731
                                                        n_seg=n_seg)
                            b = lambda: vs.hgrn_backward(x, g, None, do, None,  # noqa: E731
                                                         n_seg=n_seg)
                            f(), b()
                            row["fwd_ms"] = triton.testing.do_bench(f, warmup=5, rep=30)
                            row["bwd_ms"] = triton.testing.do_bench(b, warmup=5, rep=30)
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
    ap.add_argument("--hgrn-sweep", action="store_true")
    ap.add_argument("--sweep-T", type=int, default=65536)
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
                for impl in ("forge_dist",) + (() if args.no_fla else ("fla",)):
                    inp = make_inputs(op, T, device, requires_grad=(pas == "fwdbwd"))
                    try:
                        fn = forge_fn(op, inp, "auto")[0] if impl == "forge_dist" else \
                            fla_fn(op, inp)
                        if pas == "fwdbwd":
                            fn = with_backward(fn, inp)
                        with torch.no_grad() if pas == "fwd" else torch.enable_grad():
                            fn()
                            fn()
                            per = kernel_times(fn, args.iters)
                    except Exception as e:  # noqa: BLE001 - FLA refuses some backwards
                        print(f"[skip] {op} {T} {pas} {impl}: {str(e)[:160]}", flush=True)
                        continue
                    total = sum(per.values())
                    print(f"\n{op} T={T} {pas} {impl}: {total / 1e3:.3f} ms of kernels")
                    for name, us in per.items():
                        print(f"  {us:10.1f} us  {100 * us / total:5.1f}%  {name}")
                    result["rows"].append({"op": op, "T": T, "pass": pas, "impl": impl,
                                           "total_us": total, "kernels_us": per})
                    inp = fn = None
                    torch.cuda.empty_cache()
    if args.hgrn_sweep:
        result["hgrn_sweep"] = {"T": args.sweep_T, "rows": hgrn_sweep(args.sweep_T, device)}
    if args.tag:
        result["benchmark"] = f"kernel_profile_{args.tag}"
    print(f"wrote {results_io.write(result, Path(args.out) if args.out else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

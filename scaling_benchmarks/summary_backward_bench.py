"""Time of the shard summary's backward kernel alone, per gate kind and operand precision.

The sequence-parallel backward of a decay op runs it once per rank on the whole shard
(``forge_dist.kernels.summary_backward``); at the weak-scaling shape (B=4, 32K tokens per
GPU, H=32, K=V=128, bf16) the per-kernel profile (``results/sp_profile_*``) found it to be
most of the gap between a rank and its single-GPU time.  This times it with CUDA events for
no decay (linear_attn), scalar decay (simple_gla) and per-channel decay (gla), with bf16
operands (the default for bf16 inputs) and fp32 operands on 3xTF32
(``FORGE_DIST_SUMBWD_LOWP=0``), and each time's fraction of the HBM roofline (k, v read,
dk, dv written, plus the gate and its gradient).  Optional tile sweeps:
``--tiles 64,8 32,4`` (``BV,num_warps``).

    python scaling_benchmarks/summary_backward_bench.py --out OUT [--T 32768]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def _bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), 3.35e12)


def _time_ms(fn, warmup=3, repeats=10) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def plot(result: dict, path: Path) -> None:
    """Bars: milliseconds per gate kind, one bar per operand configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    gates = list(dict.fromkeys(r["gate"] for r in rows))
    labels = list(dict.fromkeys(r["operands"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ms = [next((r["ms"] for r in rows if r["gate"] == g and r["operands"] == label), 0)
              for g in gates]
        bars = ax.bar([i + j * width for i in range(len(gates))], ms, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(gates))], gates)
    ax.set_ylabel("ms per call")
    cfg = result["config"]
    ax.set_title(f"summary backward, B={cfg['B']} T={cfg['T']} H={cfg['H']} K=V={cfg['K']} "
                 f"bf16, {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--tiles", nargs="*", default=[], help="extra BV,num_warps configs")
    args = ap.parse_args(argv)

    from forge_dist.kernels._common import decay_summary_backward
    from forge_dist.kernels.summary_backward import decay_summary_backward_triton

    B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(B, T, H, K, device=dev, dtype=bf16, generator=gen)
    v = torch.randn(B, T, H, V, device=dev, dtype=bf16, generator=gen)
    ddelta = torch.randn(B, H, K, V, device=dev, generator=gen)
    gates = {
        "none": (None, None),
        "scalar": (torch.nn.functional.logsigmoid(
            torch.randn(B, T, H, device=dev, generator=gen) + 3), torch.randn(B, H, device=dev)),
        "vector": (torch.nn.functional.logsigmoid(
            torch.randn(B, T, H, K, device=dev, generator=gen) + 3),
            torch.randn(B, H, K, device=dev)),
    }
    bw = _bandwidth()
    result = results_io.header("summary_backward", {"B": B, "T": T, "H": H, "K": K, "V": V,
                                                     "dtype": "bfloat16",
                                                     "hbm_bytes_per_s": bw})
    configs = [("bf16", "1", None), ("tf32x3", "0", None)]
    configs += [(f"bf16 tiles {t}", "1", t) for t in args.tiles]
    for gate, (g, dM) in gates.items():
        io_bytes = 2 * (k.numel() + v.numel()) * k.element_size()
        if g is not None:
            io_bytes += 2 * g.numel() * g.element_size()
        want = decay_summary_backward(k.float(), v.float(), g, ddelta, dM)
        for label, lowp, tiles in configs:
            os.environ["FORGE_DIST_SUMBWD_LOWP"] = lowp
            if tiles:
                os.environ["FORGE_DIST_SUMBWD_TILES"] = tiles
            else:
                os.environ.pop("FORGE_DIST_SUMBWD_TILES", None)
            fn = lambda: decay_summary_backward_triton(k, v, g, ddelta, dM)  # noqa: E731
            got = fn()
            errs = {n: float((a.double() - w.double()).norm() / w.double().norm())
                    for n, a, w in zip(("dk", "dv", "dg"), got, want) if w is not None}
            ms = _time_ms(fn)
            row = {"gate": gate, "operands": label, "ms": round(ms, 4),
                   "hbm_fraction": round(io_bytes / bw / (ms * 1e-3), 3),
                   "rel_err_vs_fp32_torch": {n: float(f"{e:.3g}") for n, e in errs.items()}}
            result["rows"].append(row)
            print(row, flush=True)
    os.environ.pop("FORGE_DIST_SUMBWD_TILES", None)
    os.environ.pop("FORGE_DIST_SUMBWD_LOWP", None)
    path = results_io.write(result, args.out)
    plot(result, path.with_suffix(".png"))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

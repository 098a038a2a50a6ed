"""The phases of a sequence-parallel forward on one GPU, per segment count.

A rank of a sequence-parallel forward runs its shard's summary (rank 0's is on every later
rank's critical path), receives its incoming state, then the output walk from it.  The
2-GPU weak-scaling forward (``results/weak_scaling_*``) is about summary + pass + walk, so
this times, on one GPU at the weak-scaling shape (B=4, 32K tokens, H=32, K=V=128, bf16),
the single-GPU forward (the ideal; also from an explicit zero initial state, which once
ran 30 % faster for linear_attn), ``summary`` and ``finish(S_in)`` of a work for
``FORGE_DIST_SEGMENTS`` = auto, 1, 2, 4, 8, 16 (the summary walks segments in parallel and
the finish starts each segment from its summary state), and reports each phase's fraction
of the HBM roofline.

    python scaling_benchmarks/sp_phases.py --out OUT [--ops simple_gla,linear_attn]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402
from scaling_benchmarks.summary_backward_bench import _bandwidth, _time_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ops", default="simple_gla,linear_attn")
    ap.add_argument("--segments", default="auto,1,2,4,8,16")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=32768)
    args = ap.parse_args(argv)
    from forge_dist import kernels

    B, T, H, K, V = args.B, args.T, 32, 128, 128
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(B, T, H, d, device=dev, dtype=bf16, generator=gen) for d in (K, K, V)]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 4)
    S_in = torch.randn(B, H, K, V, device=dev, generator=gen) * 0.1
    bw = _bandwidth()
    tok_bytes = B * T * H * K * 2  # one [B, T, H, 128] bf16 tensor
    result = results_io.header("sp_phases", {"B": B, "T": T, "H": H, "K": K, "V": V,
                                              "dtype": "bfloat16", "gate_dtype": "float32",
                                              "hbm_bytes_per_s": bw})
    for op in args.ops.split(","):
        inputs = {"q": qkv[0], "k": qkv[1], "v": qkv[2], "g": g if op == "simple_gla" else None}
        gate_bytes = B * T * H * 4 if op == "simple_gla" else 0
        need_M = op != "linear_attn"
        for seg in args.segments.split(","):
            if seg == "auto":
                os.environ.pop("FORGE_DIST_SEGMENTS", None)
            else:
                os.environ["FORGE_DIST_SEGMENTS"] = seg
            with torch.no_grad():
                ideal = _time_ms(lambda: kernels.forward(op, inputs, out_dtype=bf16))
                zeros = torch.zeros_like(S_in)
                ideal_h0 = _time_ms(lambda: kernels.forward(op, inputs, initial_state=zeros,
                                                            out_dtype=bf16))

                def summary():
                    work = kernels.make_work(op, inputs, None, need_M, out_dtype=bf16)
                    work.summary(need_M)
                    return work

                t_sum = _time_ms(summary)
                works = [summary() for _ in range(13)]
                it = iter(works)
                t_fin = _time_ms(lambda: next(it).finish(S_in), warmup=3, repeats=10)
                n_seg = works[0].n_seg
            row = {"op": op, "segments": seg, "n_seg": n_seg, "ideal_ms": round(ideal, 4),
                   "ideal_zero_state_ms": round(ideal_h0, 4),
                   "summary_ms": round(t_sum, 4), "finish_ms": round(t_fin, 4),
                   "summary_hbm": round((2 * tok_bytes + gate_bytes) / bw / (t_sum * 1e-3), 3),
                   "finish_hbm": round((4 * tok_bytes + gate_bytes) / bw / (t_fin * 1e-3), 3),
                   "two_rank_estimate_ms": round(t_sum + t_fin, 4)}
            result["rows"].append(row)
            print(row, flush=True)
            del works
    os.environ.pop("FORGE_DIST_SEGMENTS", None)
    print(results_io.write(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

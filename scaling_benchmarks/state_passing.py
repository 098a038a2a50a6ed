"""The inter-rank phase alone (paper Table 2): serial, pipelined, lasp2 and forge.

    torchrun --nproc_per_node 2 scaling_benchmarks/state_passing.py [--out DIR] [--iters N]

State ``[B, H, K, V]`` fp32 with H=32, K=V=128: B=4 is 8 MiB, B=32 is 64 MiB; scalar,
diagonal and dense transitions; the forward chain and the backward chain.  Each timed
iteration starts from a device-side sync point (a one-element all-reduce after a host
barrier) so every rank starts together; a rank's time is its CUDA-event time from there to
the end of its chain call, host launch work included (that is the cost of host-driven
pipelining); an iteration's time is the largest over ranks, and a row reports the median
(and min) over iterations, warm.  Writes ``state_passing_<device>_<date>.json`` and a PNG.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import forge_dist.comm  # noqa: E402,F401  (NVLink multicast off before NCCL starts)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from forge_dist import sp  # noqa: E402
from forge_dist.sp import forge  # noqa: E402,F401  (registers "forge")
from forge_dist.variants.transitions import Kind  # noqa: E402
from scaling_benchmarks import results_io  # noqa: E402

SIZES = {8: 4, 64: 32}  # state MiB -> B (H=32, K=V=128, fp32)
KINDS = [Kind.SCALAR, Kind.DIAGONAL, Kind.DENSE]
STRATEGIES = ["serial", "pipelined", "lasp2", "forge"]


def make(kind, B, H, K, V, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    if kind is Kind.SCALAR:
        M = torch.rand(B, H, generator=g)
    elif kind is Kind.DIAGONAL:
        M = torch.rand(B, H, K, generator=g)
    else:
        M = torch.randn(B, H, K, K, generator=g) / K ** 0.5
    return M.to(device), torch.randn(B, H, K, V, device=device)


def time_one(strategy, kind, M, delta, S0, group, direction, iters, warmup):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    M_r = M if rank < size - 1 else None
    _, saved = strategy.forward_chain(kind, M_r, delta, S0, group)
    tick = torch.zeros(1, device=delta.device)

    def call():
        if direction == "fwd":
            strategy.forward_chain(kind, M_r, delta, S0, group)
        else:
            strategy.backward_chain(kind, M_r, delta, group, saved)
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        dist.barrier(group)
        dist.all_reduce(tick, group=group)  # device-side start line for every rank
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)  # us
    t = torch.tensor(times, device=delta.device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t = t.tolist()
    return statistics.median(t), min(t)


def plot(result, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = sorted({r["state_mib"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 4.5), squeeze=False)
    for ax, mib in zip(axes[0], sizes):
        groups = [(k, p) for k in [k.value for k in KINDS] for p in ("fwd", "bwd")]
        width = 0.8 / len(STRATEGIES)
        for j, strat in enumerate(STRATEGIES):
            ys = []
            for k, p in groups:
                match = [r["us"] for r in rows if r["state_mib"] == mib and r["kind"] == k
                         and r["pass"] == p and r["strategy"] == strat]
                ys.append(match[0] if match else 0.0)
            ax.bar([i + j * width for i in range(len(groups))], ys, width, label=strat)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{k}\n{p}" for k, p in groups])
        ax.set_ylabel("us (median)")
        ax.set_title(f"state passing, {mib} MiB, {result['world_size']} x {result['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results directory")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sizes", default="8,64", help="state sizes in MiB (8 and/or 64)")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    reason = sp.base._REGISTRY["forge"].available(device)
    strategies = [s for s in STRATEGIES if s != "forge" or reason is None]
    if reason is None:
        from forge_dist.comm import nvshmem
        nvshmem.setup(group)
    elif rank == 0:
        print(f"forge unavailable: {reason}", flush=True)
    H, K, V = 32, 128, 128
    sizes = [int(s) for s in args.sizes.split(",")]
    result = results_io.header("state_passing", {
        "H": H, "K": K, "V": V, "dtype": "float32", "B_by_state_mib": {m: SIZES[m] for m in sizes},
        "iters": args.iters, "warmup": args.warmup,
        "pipeline_tiles": int(os.environ.get("FORGE_DIST_PIPELINE_TILES", "4")),
        "forge_tile": list(forge.tile_shape(Kind.DENSE, K, V)),
        "timing": "CUDA events from a device-side all-reduce start line; max over ranks; "
                  "median over iterations"}, world_size=size)
    jobs = [(m, k, p, s) for m in sizes for k in KINDS for p in ("fwd", "bwd") for s in strategies]
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(jobs), desc="state_passing")
        except ImportError:
            pass
    failed = set()
    for mib, kind, direction, name in jobs:
        B = SIZES[mib]
        M, delta = make(kind, B, H, K, V, device)
        S0 = torch.randn_like(delta) if rank == 0 else torch.zeros_like(delta)
        if name in failed:
            continue
        strat = sp.resolve(name, device)
        try:
            med, best = time_one(strat, kind, M, delta, S0, group, direction, args.iters,
                                 args.warmup)
        except Exception as err:  # noqa: BLE001 - keep the baselines' rows, say what failed
            failed.add(name)
            print(f"[rank {rank}] {name} failed at {mib} MiB {kind.value} {direction}: "
                  f"{type(err).__name__}: {err}", flush=True)
            result.setdefault("failures", []).append(f"{name} {mib}MiB {kind.value} "
                                                     f"{direction}: {err}")
            continue
        result["rows"].append({"op": "state_pass", "pass": direction, "impl": "forge_dist",
                               "strategy": name, "kind": kind.value, "state_mib": mib,
                               "us": round(med, 2), "us_min": round(best, 2),
                               "world_size": size, "B": B})
        if bar is not None:
            bar.set_postfix_str(f"{mib}MiB {kind.value} {direction} {name} {med:.0f}us")
            bar.update(1)
    if bar is not None:
        bar.close()
    if reason is None:
        forge.flush(wait=True)
    if rank == 0:
        out_dir = Path(args.out) if args.out else None
        path = results_io.write(result, out_dir)
        plot(result, path.with_suffix(".png"))
        print(f"wrote {path}", flush=True)
        for r in result["rows"]:
            print(f"{r['state_mib']:>3} MiB {r['kind']:>8} {r['pass']} {r['strategy']:>9} "
                  f"{r['us']:9.1f} us (min {r['us_min']:.1f})", flush=True)
    dist.barrier(group)
    torch.cuda.synchronize()
    os._exit(0)  # skip NVSHMEM/NCCL teardown ordering issues at interpreter exit


if __name__ == "__main__":
    main()

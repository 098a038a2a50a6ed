"""Where the time of one sequence-parallel call goes: host time per call, GPU time per call,
and the kernels it runs, per rank (one process per GPU)::

    torchrun --nproc-per-node 2 scaling_benchmarks/sp_profile.py --op simple_gla \\
        --tokens 16384 --strategies forge,serial --out results_dir

For each strategy (and ``ideal``: the same op on this rank's shard alone, no group), after
warm-up calls:

* ``host_us``: the host's time to issue one call (``perf_counter`` over back-to-back calls
  with no synchronisation, divided by their number);
* ``gpu_ms``: one call between CUDA events after a barrier, median over repeats;
* ``kernels``: ``torch.profiler``'s device time per kernel name, averaged per call.

Writes ``sp_profile_<device>_<op>_<tokens>.json`` (rank 0 gathers every rank's rows).
Forward calls without gradients, as inference and the benchmarks' ``fwd`` rows make them;
``--grad``: the call with gradients and ``o.backward(do)``, as the ``fwdbwd`` rows make them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import forge_dist.comm  # noqa: E402,F401  (environment defaults before NCCL/NVSHMEM start)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from forge_dist import ops  # noqa: E402
from scaling_benchmarks import registry  # noqa: E402
from scaling_benchmarks.kernel_profile import kernel_times  # noqa: E402


def _inputs(op, B, T, H, K, V, device, seed):
    """The op's inputs from the benchmarks' registry (bf16 activations, fp32 gates)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(fn):
        return lambda *shape: fn(*shape, generator=gen).to(device)
    inp = registry.make_inputs(op, registry.Shape(B=B, H=H, K=K, V=V), T,
                               dtype=torch.bfloat16, randn=draw(torch.randn),
                               rand=draw(torch.rand))
    return {n: inp[n] for n in registry.spec(op).args}


def _call(op, x, **kw):
    with torch.no_grad():
        return getattr(ops, op)(*x.values(), **kw)[0]


def _call_grad(op, x, do, **kw):
    """Forward with gradients, then the backward of ``(o * do).sum()``."""
    o = getattr(ops, op)(*x.values(), **kw)[0]
    o.backward(do)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="simple_gla", choices=list(registry.NAMES))
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--strategies", default="forge,serial")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=".")
    ap.add_argument("--grad", action="store_true",
                    help="forward with gradients and backward (the fwdbwd rows' call)")
    ap.add_argument("--trace", action="store_true",
                    help="also write a Chrome trace of 3 calls per strategy and rank")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also cProfile N calls per strategy and print rank 0's top functions")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    rank, P = dist.get_rank(), dist.get_world_size()
    x = _inputs(a.op, a.B, a.tokens, a.H, a.K, a.V, device, seed=rank)
    do = None
    if a.grad:
        x = {n: t.requires_grad_(True) for n, t in x.items()}
        first = x[registry.spec(a.op).first]
        do = torch.randn(*first.shape[:-1], first.shape[-1] if registry.spec(a.op).vector_state else a.V,
                         device=device, dtype=torch.bfloat16)
    rows = []
    for strategy in ["ideal"] + a.strategies.split(","):
        kw = {} if strategy == "ideal" else {"group": group, "strategy": strategy}

        def call():
            if a.grad:
                return _call_grad(a.op, x, do, **kw)
            return _call(a.op, x, **kw)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        times = []
        for _ in range(a.repeats):
            dist.barrier()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        dist.barrier()
        kernels = kernel_times(call, 10)
        if a.trace:
            from torch.profiler import ProfilerActivity, profile

            dist.barrier()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            Path(a.out).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(a.out) / f"trace_{a.op}_{strategy}_rank{rank}.json"))
        if a.host_profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.host_profile):
                call()
            prof.disable()
            torch.cuda.synchronize()
            if rank == 0:
                buf = io.StringIO()
                stats = pstats.Stats(prof, stream=buf)
                stats.sort_stats("tottime").print_stats(22)
                stats.sort_stats("cumulative").print_stats(40)
                print(f"[rank 0] {strategy}: host profile of {a.host_profile} calls\n"
                      + buf.getvalue(), flush=True)
            dist.barrier()
        rows.append({"rank": rank, "strategy": strategy, "host_us": round(host_us, 1),
                     "gpu_ms": round(statistics.median(times), 4), "kernels_us": kernels})
        print(f"[rank {rank}] {strategy}: host {host_us:.0f} us/call, gpu "
              f"{statistics.median(times):.3f} ms; " + ", ".join(
                  f"{k[:40]} {v:.0f}" for k, v in list(kernels.items())[:6]), flush=True)
    everyone = [None] * P
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        name = torch.cuda.get_device_name(device).replace(" ", "-")
        Path(a.out).mkdir(parents=True, exist_ok=True)
        path = Path(a.out) / f"sp_profile_{name}_{a.op}_{a.tokens}{'_grad' if a.grad else ''}.json"
        path.write_text(json.dumps({"device": name, "world_size": P, "torch": torch.__version__,
                                    "commit": os.environ.get("FORGE_DIST_COMMIT", "unknown"),
                                    "config": vars(a), "rows": [r for rr in everyone for r in rr]},
                                   indent=1))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

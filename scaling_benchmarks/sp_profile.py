"""Where a sequence-parallel op call spends its GPU time, per rank and per kernel.

Each rank runs one op forward + backward on its shard (the weak-scaling shape of
``configs/weak_scaling.toml``: B=4, H=32, K=V=128, 32K tokens per GPU, bf16) under
``torch.profiler``, first alone on its GPU (``ideal``: no group) and then with the
sequence-parallel group (``--strategies``).  Every CUDA kernel's device time is summed by name
and divided by the iteration count (microseconds per call); rank 0 gathers every rank's table
into one JSON.  The weak-scaling benchmark says how far a strategy is from its ideal; this
says which kernels make the difference.

    torchrun --nproc_per_node 2 scaling_benchmarks/sp_profile.py --ops linear_attn --out OUT
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_dist import config as cfg_mod  # noqa: E402
from forge_dist import launch_env  # noqa: E402
from scaling_benchmarks import results_io  # noqa: E402
from scaling_benchmarks.kernel_profile import kernel_times  # noqa: E402
from scaling_benchmarks.weak_scaling import DEFAULTS, call_op, make_inputs  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "weak_scaling.toml"


def profile_call(op: str, cfg, device, group, strategy: str, iters: int) -> dict:
    """``{kernel: us per call}`` of one forward + backward on this rank's shard."""
    inp = make_inputs(op, cfg, int(cfg["tokens_per_gpu"]), device, seed=dist.get_rank(),
                      requires_grad=True)

    def step():
        for t in inp.values():
            t.grad = None
        o = call_op(op, inp, group=group, strategy=strategy)
        o.backward(torch.ones_like(o))

    for _ in range(2):  # compile and warm up
        step()
    return kernel_times(step, iters)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default="linear_attn", help="comma-separated op names")
    p.add_argument("--strategies", default="lasp2", help="comma-separated strategies")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels printed per table")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = cfg_mod.load(DEFAULTS, str(CONFIG))
    _, device = launch_env.init_device_world(cpu=False, timeout_s=120)
    if device.type != "cuda":
        raise SystemExit("sp_profile.py needs one GPU per rank")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    result = results_io.header("sp_profile", {"ops": args.ops, "strategies": args.strategies,
                                              "iters": args.iters, **cfg}, world)
    for op in args.ops.split(","):
        for strategy in ["ideal"] + args.strategies.split(","):
            times = profile_call(op, cfg, device, None if strategy == "ideal" else group,
                                 "auto" if strategy == "ideal" else strategy, args.iters)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, times)
            if rank == 0:
                for r, t in enumerate(per_rank):
                    result["rows"].append({"op": op, "strategy": strategy, "rank": r,
                                           "total_us": sum(t.values()), "kernels": t})
                    print(f"== {op} {strategy} rank {r}: {sum(t.values()):.0f} us")
                    for name, us in list(t.items())[:args.top]:
                        print(f"   {us:9.1f}  {name[:100]}")
                results_io.write(result, Path(args.out) if args.out else None)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

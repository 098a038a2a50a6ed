"""A rank of ``mpirun -np 2`` (tests/benchmarks/test_launchers.py): forge_dist.launch_env
reads Open MPI's variables, takes rank 0's host from mpi4py (no MASTER_ADDR is set), starts
a gloo group, and ``hier`` runs the delta rule against the fp64 recurrence; writes
``<out>/rank<r>.json``."""
import json
import os
import sys

import torch
import torch.distributed as dist

from forge_dist import launch_env
from forge_dist.selftest import run_case, tolerance


def main(out_dir: str) -> None:
    info = launch_env.init_distributed(backend="gloo", timeout_s=120)
    res = run_case("gated_delta_rule", "hier", torch.float64, True, group=dist.group.WORLD,
                   T_local=12).as_dict()
    worst = max(res["errors"].values())
    report = {"source": info.source, "rank": info.rank, "world": info.world_size,
              "master": info.master_addr, "worst": worst,
              "ok": worst <= tolerance(torch.float64)}
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

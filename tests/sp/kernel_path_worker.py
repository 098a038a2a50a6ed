"""Run under torchrun (2 GPUs): every op through the Triton kernels over NCCL (lasp2), fp32,
forward and backward against the fp64 reference.  Prints one line per case and exits 1 if
any relative RMSE exceeds 3e-3.  A watchdog dumps the stacks and exits if it stalls."""
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

from forge_dist.comm_env import set_launch_defaults
from forge_dist.selftest import OPS, run_case

TOL = 3e-3


def main() -> int:
    set_launch_defaults()
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_WATCHDOG_S", "120")),
                                      exit=True)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    worst = 0.0
    try:
        for op in OPS:
            for varlen in (False, True):
                t0 = time.time()
                res = run_case(op, "lasp2", torch.float32, varlen, group=dist.group.WORLD,
                               device="cuda", T_local=96, dims=(32, 48, 64))
                worst = max(worst, res.max_error)
                if rank == 0:
                    print(f"{op} {'packed' if varlen else 'dense'} {time.time() - t0:.1f}s "
                          f"max_rel_err={res.max_error:.2e}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())

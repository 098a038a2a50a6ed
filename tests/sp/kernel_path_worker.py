"""Run under torchrun (2 GPUs): every op through the Triton kernels over NCCL (lasp2), fp32,
forward and backward against the fp64 reference.  Prints one line per case and exits 1 if
any relative RMSE exceeds 3e-3.

A watchdog dumps the stacks and exits (code 1) if one case stalls: it is re-armed for every
case (``WORKER_WATCHDOG_S`` seconds each, default 300, which a cold Triton cache compiling
every kernel of a case must fit).  It used to be armed once, 120 s for the whole run, so a
run that compiled all its kernels from a cold cache (the first run after a kernel change, or
on a fresh machine) could overrun it with nothing wrong and exit 1 (the likeliest cause of a
"rank 0 exited 1" of this test in a full multigpu run that passed when run again alone, on
the then warm cache).  Every rank says on stderr which case it starts, so its log shows
where it was."""
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
    watchdog_s = float(os.environ.get("WORKER_WATCHDOG_S", "300"))
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(watchdog_s, exit=True)  # the rendezvous
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    worst = 0.0
    try:
        for op in OPS:
            for varlen in (False, True):
                case = f"{op} {'packed' if varlen else 'dense'}"
                print(f"rank {rank}: {case} starts (watchdog {watchdog_s:g}s)", file=sys.stderr,
                      flush=True)
                faulthandler.dump_traceback_later(watchdog_s, exit=True)  # re-armed per case
                t0 = time.time()
                res = run_case(op, "lasp2", torch.float32, varlen, group=dist.group.WORLD,
                               device="cuda", T_local=96, dims=(32, 48, 64))
                worst = max(worst, res.max_error)
                if rank == 0:
                    print(f"{case} {time.time() - t0:.1f}s max_rel_err={res.max_error:.2e}",
                          flush=True)
                if not res.max_error <= TOL:
                    print(f"rank {rank}: {case} max_rel_err={res.max_error:.2e} above {TOL:g}",
                          file=sys.stderr, flush=True)
        faulthandler.cancel_dump_traceback_later()
    finally:
        dist.destroy_process_group()
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())

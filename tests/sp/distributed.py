"""Spawn a local gloo world, run a function on every rank, return rank 0's result."""
from __future__ import annotations

import gc
import json
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from forge_dist.selftest import free_port, init_local_gloo

from .. import _spawn


def _worker(rank, world, port, fn, args, out_path, backend, device):
    if backend == "nccl":
        import torch

        from forge_dist.comm_env import set_launch_defaults

        set_launch_defaults()
        torch.cuda.set_device(rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        init_local_gloo(rank, world, port)
    try:
        kwargs = {} if device is None else {"device": device}
        result = fn(dist.group.WORLD, *args, **kwargs)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        # every rank done before any tears its connections down: a rank that leaves while
        # a peer still finishes its last exchange makes gloo abort that peer (SIGABRT)
        dist.barrier()
    finally:
        gc.collect()  # objects of the run that still hold the group go before it does
        dist.destroy_process_group()


_PORT_TRIES = 3


def _port_taken(err: Exception) -> bool:
    """Whether a spawned world failed because rank 0 could not bind the rendezvous port."""
    text = str(err)
    return "EADDRINUSE" in text or "Address already in use" in text


def run_world(world: int, fn, *args, env=None, backend: str = "gloo", kwargs_device=None):
    """Run ``fn(group, *args)`` on ``world`` ranks (gloo on the CPU, or NCCL with one GPU per
    rank); returns rank 0's JSON-able result.

    The rendezvous port is one the OS had free (``free_port``), but it is released before
    rank 0 binds it, and another process (an NCCL socket of a world just torn down, another
    job) may take it in between: then the world is started again on a new port, up to
    ``_PORT_TRIES`` times (rank 0 failed in ``init_process_group``, so ``fn`` ran nowhere).
    Any other failure raises ``mp.ProcessRaisedException``/``ProcessExitedException``, whose
    message holds the failing rank's traceback."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            for attempt in range(_PORT_TRIES):
                try:
                    # mp.spawn's processes, started from a server that imported torch once
                    _spawn.start_processes(_worker, args=(world, free_port(), fn, args, out,
                                                          backend, kwargs_device),
                                           nprocs=world, join=True)
                    break
                except mp.ProcessRaisedException as err:
                    if attempt == _PORT_TRIES - 1 or not _port_taken(err):
                        raise
            with open(out) as f:
                return json.load(f)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

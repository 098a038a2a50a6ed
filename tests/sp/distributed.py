"""Spawn a local gloo world, run a function on every rank, return rank 0's result."""
from __future__ import annotations

import json
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from forge_dist.selftest import free_port, init_local_gloo


def _worker(rank, world, port, fn, args, out_path):
    init_local_gloo(rank, world, port)
    try:
        result = fn(dist.group.WORLD, *args)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn, *args, env=None):
    """Run ``fn(group, *args)`` on ``world`` gloo ranks; returns rank 0's JSON-able result."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
            with open(out) as f:
                return json.load(f)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

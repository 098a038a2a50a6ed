"""What the sequence-parallel benchmarks share (``layers.py --sp``, ``dsl_variants.py --sp``):
the process group, a loop of rows that outlives a failed one, and the local launch.

Each benchmark runs one process per rank (torchrun on GPUs, or spawned gloo processes on the
CPU for a check of the code path) and writes rows as they complete; rank 0 writes the file.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402


@dataclass
class World:
    """This rank's device, the benchmark's group, and the loop's own (``control``)."""

    device: torch.device
    group: Any
    control: Any
    bound: datetime.timedelta
    rank: int
    size: int

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"


def start(cpu: bool) -> World:
    """The process group of this launch (gloo on the CPU, NCCL with one GPU per rank), every
    wait bounded: a rank that raised where its peers do not wait for it must not leave
    them in a collective for NCCL's or gloo's default of 10-30 minutes."""
    import torch.distributed as dist

    from forge_dist import launch_env
    from forge_dist.sp import p2p

    info = launch_env.detect(use_mpi4py=False)
    cpu = cpu or not torch.cuda.is_available()
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(info.local_rank)
        device, backend = torch.device("cuda", info.local_rank), "nccl"
    bound = datetime.timedelta(seconds=p2p.timeout_seconds())
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=bound,
                            **({"device_id": device} if device.type == "cuda" else {}))
    group = dist.new_group(list(range(dist.get_world_size())), timeout=bound)
    return World(device, group, dist.group.WORLD, bound, dist.get_rank(),
                 dist.get_world_size())


def run_rows(world: World, items: Iterable[Any], make_rows: Callable[[Any, Any], List[Dict]],
             failed_row: Callable[[Any, str], Dict], result: Dict, out_dir,
             plot: Callable[[Dict, Path], None]) -> Path:
    """``make_rows(item, group)`` on every rank for each item, its rows added to ``result``
    and the file rewritten as they complete; a call that raises on any rank gives
    ``failed_row(item, reason)`` and every rank goes on with a new group (the failed call
    may have left collectives half done).  Then the PNG (``plot(result, png)``); returns
    the JSON's path."""
    import torch.distributed as dist

    path = results_io.results_path(result, out_dir)
    if world.rank == 0:
        path = results_io.write(result, out_dir)
    for item in items:
        try:
            rows = make_rows(item, world.group)
        except Exception as e:  # noqa: BLE001 - recorded; the next item runs
            traceback.print_exc()
            first = str(e).splitlines()[0][:300] if str(e) else ""
            rows = [failed_row(item, f"rank {world.rank}: {type(e).__name__}: {first}")]
        everyone = [None] * world.size
        dist.all_gather_object(everyone, rows, group=world.control)
        failed = [rs for rs in everyone if any("skipped" in row for row in rs)]
        if failed:
            rows = failed[0]
            world.group = dist.new_group(list(range(world.size)), timeout=world.bound)
        if world.rank == 0:
            result["rows"].extend(rows)
            results_io.write(result, out_dir)
            for row in rows:
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "per_rank"}, flush=True)
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
    if world.rank == 0:
        try:
            plot(result, path.with_suffix(".png"))
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e}", file=sys.stderr)
        print(f"wrote {path}")
    dist.destroy_process_group()
    return path


def _spawned(rank: int, world: int, port: int, worker, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(args)


def launch(worker: Callable[[Any], int], args, world: int) -> int:
    """``worker(args)`` on this launch's ranks: under torchrun (or any launcher) here, else
    ``world`` spawned processes on this machine (the CPU check)."""
    import torch.multiprocessing as mp

    from forge_dist import launch_env
    from forge_dist.selftest import free_port

    if launch_env.detect(use_mpi4py=False).source != "single":
        return worker(args)
    try:
        mp.start_processes(_spawned, args=(world, free_port(), worker, args), nprocs=world,
                           join=True, start_method="spawn")
    except mp.ProcessExitedException as err:
        return err.exit_code or 1
    return 0

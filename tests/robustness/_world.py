"""A gloo world for fault tests: ranks may crash, stall or raise; the parent never hangs.

Unlike ``tests/sp/distributed.run_world`` (``mp.spawn``, which kills every rank as soon as
one dies), each rank here writes its own JSON result, a rank that exits early simply has
none, and the parent kills whatever is still alive at the deadline (reported as ``hung``).
Ranks can tear their process group down and join a fresh one (:meth:`Rank.join`), with
any subset of the original ranks, to show that an op works again after a failure.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback

from .. import _spawn


class Rank:
    """What a rank function gets: its rank, the world size and group (re)creation."""

    def __init__(self, rank: int, size: int, tmp: str):
        self.rank, self.size, self.tmp = rank, size, tmp
        self.group = None

    def join(self, tag: str, rank: int = None, size: int = None):
        """Destroy the current default group (if any) and join the gloo group ``tag``."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        rank = self.rank if rank is None else rank
        size = self.size if size is None else size
        dist.init_process_group("gloo", init_method=f"file://{self.tmp}/store_{tag}",
                                rank=rank, world_size=size)
        self.group = dist.group.WORLD
        return self.group


def _entry(rank, size, tmp, fn, args, env):
    from forge_dist.selftest import share_cores

    os.environ.update(env or {})
    share_cores(size)
    me = Rank(rank, size, tmp)
    try:
        me.join("initial")
        result = fn(me, *args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result = {"fatal": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(size: int, fn, *args, env=None, deadline_s: float = 90.0):
    """Run ``fn(Rank, *args)`` on ``size`` processes; returns one entry per rank: its JSON
    result, ``{"exitcode": c}`` when it died without one, or ``{"hung": True}``."""
    with tempfile.TemporaryDirectory() as tmp:
        # processes as spawn's, started from a server that imported torch once (tests/_spawn.py)
        procs = [_spawn.process(_entry, (r, size, tmp, fn, args, env)) for r in range(size)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        out = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                out.append({"hung": True})
                continue
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(json.load(f))
            else:
                out.append({"exitcode": p.exitcode})
        return out

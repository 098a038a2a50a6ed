"""Rank, world size and rendezvous address from whatever launched this process.

Every script of ours starts the same way whether it runs under ``torchrun``, ``srun`` (one
task per GPU) or ``mpirun``::

    from forge_dist import launch_env
    info = launch_env.init_distributed()        # or launch_env.detect() to only look

Sources, first match wins (:func:`detect`):

1. ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``.
2. slurm (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``; the master is the first host of
   ``SLURM_JOB_NODELIST`` (``scontrol show hostnames`` when available, else our own parser
   of the compressed list ``node[01-04,07]``); the port derives from ``SLURM_JOB_ID`` so
   concurrent jobs on one node do not collide.
3. Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``), MPICH/Intel MPI/PMIx
   (``PMI_RANK``/``PMI_SIZE``, ``PMIX_RANK``, ``MPI_LOCALRANKID``).  MPI launchers do not
   name a master: ``MASTER_ADDR`` must be set, or mpi4py is used to broadcast rank 0's host.
4. mpi4py alone (``COMM_WORLD``) when it is importable and the world has more than one rank.
5. Nothing: a single process (rank 0 of 1).

:func:`export` writes the result back as ``RANK``/``WORLD_SIZE``/... so that
``init_process_group(init_method="env://")`` and torch's NVSHMEM bootstrap (which reads the
same variables) agree.  ``python -m forge_dist.launch_env`` prints what it found, which is
what the slurm scripts' ``DRY_RUN=1`` mode shows.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import List, Mapping, Optional

DEFAULT_PORT = 29500


@dataclass
class LaunchInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "ompi", "pmi", "mpi4py" or "single"

    @property
    def node_rank(self) -> int:
        return self.rank // max(1, self.local_world_size)


def _int(env: Mapping[str, str], *keys: str) -> Optional[int]:
    for key in keys:
        value = env.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {key}={value!r} is not an integer") \
                    from None
    return None


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand slurm's compressed host list, e.g. ``a[01-03,7],b5`` -> ``a01 a02 a03 a7 b5``.

    Covers the forms slurm prints (ranges keep their zero padding; several bracket groups in
    one name expand as a product).  ``scontrol show hostnames`` is preferred where it exists.
    """
    hosts: List[str] = []
    # Split on commas that are not inside brackets.
    parts, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        names = [""]
        for prefix, group in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            if not prefix and not group:
                continue
            alts = [""]
            if group:
                alts = []
                for item in group.split(","):
                    if "-" in item:
                        lo, hi = item.split("-", 1)
                        width = len(lo)
                        alts += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    else:
                        alts.append(item)
            names = [n + prefix + a for n in names for a in alts]
        hosts += names
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a slurm node list (``scontrol show hostnames`` if available)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass  # fall back to our parser
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}")
    return hosts[0]


def _slurm_tasks_per_node(env: Mapping[str, str], world: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "8(x4)" or "8,4"; the first count is ours for rank 0's
    # node and, with the homogeneous layouts we launch, for every node.
    n = _int(env, "SLURM_NTASKS_PER_NODE")
    if n:
        return n
    raw = env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"(\d+)", raw)
    if m:
        return int(m.group(1))
    nodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    return max(1, world // nodes)


def _slurm_port(env: Mapping[str, str]) -> int:
    job = _int(env, "SLURM_JOB_ID") or 0
    return 20000 + job % 20000  # [20000, 40000): above most ephemeral-port-free defaults


def detect(env: Optional[Mapping[str, str]] = None, *, use_mpi4py: bool = True) -> LaunchInfo:
    """Rank, world and rendezvous of this process; see the module docstring for the order.

    ``env`` defaults to ``os.environ``; tests pass a dict.  ``MASTER_ADDR``/``MASTER_PORT``,
    when set, always win over derived values.
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")

    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        local = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE")
        return LaunchInfo(rank, world, local if local is not None else rank,
                          local_world or world, addr or "127.0.0.1", port or DEFAULT_PORT,
                          "torchrun")

    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is not None and world is not None:
        local = _int(env, "SLURM_LOCALID")
        per_node = _slurm_tasks_per_node(env, world)
        if addr is None:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            addr = first_host(nodelist) if nodelist else "127.0.0.1"
        return LaunchInfo(rank, world, local if local is not None else rank % per_node,
                          per_node, addr, port or _slurm_port(env), "slurm")

    for source, rank_keys, size_keys, local_keys, local_size_keys in (
            ("ompi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
             ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
            ("pmi", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE", "PMIX_SIZE"),
             ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"),
             ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"))):
        rank, world = _int(env, *rank_keys), _int(env, *size_keys)
        if rank is None or world is None:
            continue
        local = _int(env, *local_keys)
        local_world = _int(env, *local_size_keys)
        if addr is None:
            addr = _mpi4py_master() if use_mpi4py else None
            if addr is None:
                raise RuntimeError(f"{source}: launched by MPI without MASTER_ADDR and mpi4py "
                                   "cannot broadcast rank 0's host: export MASTER_ADDR")
        return LaunchInfo(rank, world, local if local is not None else 0,
                          local_world or 1, addr, port or DEFAULT_PORT, source)

    if use_mpi4py:
        found = _from_mpi4py(addr, port)
        if found is not None:
            return found
    return LaunchInfo(0, 1, 0, 1, addr or "127.0.0.1", port or DEFAULT_PORT, "single")


def _mpi4py_comm():
    try:
        from mpi4py import MPI  # noqa: WPS433  (optional: mpi4py, the extra "mpi")
    except Exception:  # noqa: BLE001 - absent or broken MPI: not our launcher
        return None
    return MPI.COMM_WORLD


def _mpi4py_master() -> Optional[str]:
    comm = _mpi4py_comm()
    if comm is None:
        return None
    return comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)


def _from_mpi4py(addr: Optional[str], port: Optional[int]) -> Optional[LaunchInfo]:
    comm = _mpi4py_comm()
    if comm is None or comm.Get_size() <= 1:
        return None
    host = socket.gethostname()
    hosts = comm.allgather(host)
    rank = comm.Get_rank()
    local = hosts[:rank].count(host)
    master = addr or hosts[0]
    return LaunchInfo(rank, comm.Get_size(), local, hosts.count(host), master,
                      port or DEFAULT_PORT, "mpi4py")


def export(info: LaunchInfo, env=None) -> None:
    """Write ``info`` as the torchrun variables (what ``env://`` and NVSHMEM read)."""
    env = os.environ if env is None else env
    env.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
               LOCAL_RANK=str(info.local_rank), LOCAL_WORLD_SIZE=str(info.local_world_size),
               MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port))


def init_distributed(backend: Optional[str] = None, *, timeout_s: float = 600.0,
                     device_type: Optional[str] = None) -> LaunchInfo:
    """Detect, export, pick the device, set our NCCL/NVSHMEM defaults, init the group.

    ``backend`` defaults to ``nccl`` with CUDA and ``gloo`` without.  A world of one still
    gets a process group (so code paths match), on a free loopback port if none was given.
    ``timeout_s`` bounds collectives (NCCL's watchdog aborts a hung job after it).
    """
    # lazy: slurm/common.sh loads this file by path, with the standard library only
    import torch
    import torch.distributed as dist  # lazy: as above

    from .comm_env import set_launch_defaults  # lazy: as above (no package when by path)

    set_launch_defaults()
    info = detect()
    if info.world_size == 1 and "MASTER_PORT" not in os.environ:
        from .selftest import free_port  # lazy: this file loads by path (slurm/common.sh)

        info.master_port = free_port()
    export(info)
    use_cuda = (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if use_cuda:
        n = torch.cuda.device_count()
        if info.local_rank >= n:
            raise RuntimeError(f"rank {info.rank}: local rank {info.local_rank} but only {n} "
                               "GPU(s) visible; launch one task per GPU")
        torch.cuda.set_device(info.local_rank)  # before NCCL and NVSHMEM initialise
    backend = backend or ("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=info.rank,
                                world_size=info.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return info


def init_device_world(*, cpu: bool, timeout_s: float):
    """:func:`init_distributed` for a benchmark rank: NCCL and this rank's GPU unless ``cpu``
    is asked for or no GPU is visible, else gloo on the CPU.  Returns ``(info, device)``."""
    import torch  # lazy: this file loads by path, stdlib only (slurm/common.sh)

    use_cuda = not cpu and torch.cuda.is_available()
    info = init_distributed("nccl" if use_cuda else "gloo", timeout_s=timeout_s,
                            device_type="cuda" if use_cuda else "cpu")
    device = torch.device("cuda", info.local_rank) if use_cuda else torch.device("cpu")
    return info, device


def main(argv: Optional[List[str]] = None) -> int:
    """Print the detected launch environment (one ``key=value`` per line, or JSON)."""
    p = argparse.ArgumentParser(prog="python -m forge_dist.launch_env",
                                description=main.__doc__)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-mpi4py", action="store_true", help="never import mpi4py")
    args = p.parse_args(argv)
    info = detect(use_mpi4py=not args.no_mpi4py)
    fields = asdict(info)
    fields["node_rank"] = info.node_rank
    if args.json:
        print(json.dumps(fields))
    else:
        print("\n".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

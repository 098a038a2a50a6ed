"""The ``forge-dist`` command: ``demo``, ``info`` and ``compile`` (help text in ``USAGE``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from . import __version__, selftest, sp
from .comm import nvshmem
from .comm_env import set_launch_defaults
from .runtime.compile_cli import main as compile_main
from .sp import choice, layout
from .variants.transitions import Kind

# Printed by ``forge-dist --help``: plain text, no markup.
USAGE = """\
usage: forge-dist {demo,info,compile} [options]

commands:
  demo     Run every op with every strategy across a small world (3 gloo processes on the
           CPU; NCCL with one process per GPU when there are two or more GPUs), forward and
           backward, check each against the fp64 reference and print a table.
           Exits 1 if any check fails.
  info     Print versions, GPUs and their links, NVSHMEM availability and the registered
           strategies: what is needed to debug a launch.
  compile  Build every kernel a config declares ahead of time (sm_90 by default, no GPU
           needed) into an on-disk cache that plans load instead of compiling.

'forge-dist COMMAND --help' describes a command's options.
"""


def _demo_worker(rank, world, port, backend, cases, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        selftest.share_cores(world)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        for op, strategy, dtype_name, varlen in cases:
            res = selftest.run_case(op, strategy, getattr(torch, dtype_name), varlen,
                                    group=dist.group.WORLD, device=device)
            if rank == 0:
                queue.put(res.as_dict())
    except Exception as err:  # report, then let the parent fail loudly
        if rank == 0:
            queue.put({"error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        dist.destroy_process_group()


def demo(argv: Optional[List[str]] = None) -> int:
    """Run the cross-check matrix; returns the process exit code (1 if any check fails)."""
    p = argparse.ArgumentParser(
        prog="forge-dist demo",
        description="Run every op with every strategy across a small world, forward and "
                    "backward, check each result against the fp64 reference and print a "
                    "table. Exits 1 if any check fails.")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: the GPU count if >= 2, else 3 CPU processes)")
    p.add_argument("--ops", default=",".join(selftest.OPS),
                   help="comma-separated ops to check (default: %(default)s)")
    p.add_argument("--strategies", default=",".join(selftest.STRATEGIES),
                   help="comma-separated state-passing strategies to check; 'forge' needs "
                        "two or more GPUs with NVSHMEM (default: %(default)s)")
    p.add_argument("--dtypes", default="float64,float32",
                   help="comma-separated input dtypes, float64 and/or float32; each is "
                        "checked against the fp64 reference with its own tolerance "
                        "(default: %(default)s)")
    p.add_argument("--cpu", action="store_true", help="use gloo on the CPU even with GPUs")
    args = p.parse_args(argv)

    n_gpu = 0 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    backend = "nccl" if n_gpu >= 2 else "gloo"
    world = args.world if args.world is not None else (n_gpu if backend == "nccl" else 3)
    if not 1 <= world <= 64:
        p.error(f"--world: expected 1..64 ranks, got {world}")
    if backend == "nccl" and world > n_gpu:
        p.error(f"--world: {world} ranks need {world} GPUs, this machine has {n_gpu}")
    ops_ = [o for o in args.ops.split(",") if o]
    for o in ops_:
        if o not in selftest.OPS:
            p.error(f"--ops: unknown op {o!r}; choose from {', '.join(selftest.OPS)}")
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in sp.names() or s == "auto":
            p.error(f"--strategies: unknown strategy {s!r}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in ("float64", "float32"):
            p.error(f"--dtypes: expected float64 and/or float32, got {d!r}")
    cases = [(o, s, d, vl) for o in ops_ for s in strategies for d in dtypes
             for vl in (False, True)]

    if backend == "nccl":
        set_launch_defaults()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    print(f"forge-dist demo: {len(cases)} checks on {world} {backend} rank(s) "
          f"({'GPU' if backend == 'nccl' else 'CPU'}), forward and backward vs fp64 reference")
    procs = mp.start_processes(_demo_worker, args=(world, selftest.free_port(), backend, cases,
                                                   queue), nprocs=world, join=False,
                               start_method="spawn")
    rows, failed = [], []
    with tqdm(total=len(cases), unit="check", file=sys.stderr) as bar:
        while len(rows) < len(cases):
            try:
                item = queue.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: check the workers are alive
                if not any(proc.is_alive() for proc in procs.processes):
                    break
                continue
            if "error" in item:
                failed.append(item["error"])
                break
            rows.append(item)
            bar.update(1)
    try:
        procs.join()
    except Exception as err:  # noqa: BLE001
        failed.append(str(err).strip().splitlines()[-1] if str(err).strip() else repr(err))
    print(f"\n{'variant':<18}{'strategy':<11}{'world':>5}  {'dtype':<8}{'layout':<8}"
          f"{'max rel err':>12}{'tolerance':>11}{'time s':>8}")
    n_bad = 0
    for r in rows:
        tol = selftest.tolerance(getattr(torch, r["dtype"]))
        worst = max(r["errors"].values())
        ok = worst <= tol
        n_bad += not ok
        print(f"{r['op']:<18}{r['strategy']:<11}{r['world_size']:>5}  {r['dtype']:<8}"
              f"{'packed' if r['varlen'] else 'dense':<8}{worst:>12.2e}{tol:>11.0e}"
              f"{r['seconds']:>8.2f}{'' if ok else '  FAIL'}")
    print(f"\n{len(rows) - n_bad} passed, {n_bad + len(cases) - len(rows)} failed")
    for msg in failed:
        print(f"error: {msg}", file=sys.stderr)
    return 0 if (n_bad == 0 and len(rows) == len(cases) and not failed) else 1


def info(argv: Optional[List[str]] = None) -> int:
    """Print versions, devices, links, NVSHMEM availability and the registered strategies."""
    argparse.ArgumentParser(prog="forge-dist info", description=info.__doc__).parse_args(argv)
    lines = [f"forge_dist {__version__}", f"python {sys.version.split()[0]}",
             f"torch {torch.__version__}"]
    try:
        import triton  # optional: the gpu extra

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed (the PyTorch paths still work)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {prop.name}, {prop.multi_processor_count} SMs, "
                         f"{prop.total_memory / 2**30:.0f} GiB")
        n = torch.cuda.device_count()
        for i in range(n):
            peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
            lines.append(f"cuda:{i} peer access to {peers or 'none'}")
    else:
        lines.append("cuda: not available")
    try:
        reason = nvshmem.unavailable_reason()
        lines.append("nvshmem: " + ("usable through torch symmetric memory" if reason is None
                                    else f"unavailable ({reason})") +
                     f"; inter-node transport {nvshmem.remote_transport()}")
    except Exception as err:  # noqa: BLE001 - info must never fail on a broken extra
        lines.append(f"nvshmem: unavailable ({err})")
    lines.append("torch.distributed: " + ("available" if dist.is_available() else "missing") +
                 f", nccl={'yes' if dist.is_available() and dist.is_nccl_available() else 'no'}"
                 f", gloo={'yes' if dist.is_available() and dist.is_gloo_available() else 'no'}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "FORGE_DIST_TIMEOUT"):
        if key in os.environ:
            lines.append(f"env {key}={os.environ[key]}")
    lines.append(f"strategies: {', '.join(sp.names())}")
    lines += _auto_lines()
    if sp.FORGE_IMPORT_ERROR:
        lines.append(f"forge strategy unavailable: {sp.FORGE_IMPORT_ERROR}")
    print("\n".join(lines))
    return 0


def _auto_lines() -> List[str]:
    """This process's node and what ``auto`` picks on CUDA for this job's layout (from the
    launcher's WORLD_SIZE and LOCAL_WORLD_SIZE; without a launcher, 8 and 64 GPUs in nodes of
    8), per transition kind, for a state of B=1, H=32, K=V=128."""
    lines = [f"node of this process (hier, auto): {layout.node_of_this_process()}"]
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    jobs = ([(int(world), int(local) if local.isdigit() else int(world))]
            if world.isdigit() else [(8, 8), (64, 8)])
    for P, L in jobs:
        nodes = [list(range(i, min(P, i + L))) for i in range(0, P, L)]
        picks = []
        for kind in Kind:
            best, times = choice.pick(nodes, kind, 1, 32, 128, 128)
            picks.append(f"{kind.value} {best} ({', '.join(f'{s} {t:.0f}' for s, t in times.items())} us)")
        lines.append(f"auto on CUDA, {P} ranks in nodes of {L}: " + "; ".join(picks))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    def compile_(args):
        return compile_main(args)
    commands = {"demo": demo, "info": info, "compile": compile_}
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] not in commands:
        print(f"forge-dist: unknown command {argv[0]!r}; choose from {', '.join(commands)}",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""The catalogue of DSL variants sequence-parallel: what a variant adds over its one-shard time,
against what the nearest built-in op adds over its own.

Run by ``dsl_variants.py --sp`` under torchrun (one GPU per rank, NCCL), or on the CPU with
``--cpu --world N`` (gloo processes, tiny shards: a check of the code path, not a timing).
Each rank builds the same global inputs (the catalogue's problem, features bf16, per-head
scalars fp32) and takes its shard of the sequence.  Per variant, forward under
``torch.no_grad``, four timings, every rank at once:

* ``dsl``: the variant on the rank's shard alone (``shard_ms``) and with the group
  (``ms``, the strategy given, ``forge`` by default);
* ``builtin``: the nearest built-in op on the inputs mapped beforehand, the same two ways.

Rows: one per variant and impl with ``ratio = ms / shard_ms``; the ``dsl`` row also has
``builtin_ratio`` and ``meets_target`` (issue 36: with 2 ranks a DSL variant costs no more over
its one-shard time than the built-in does: ``ratio <= builtin_ratio``).  Times as in
``weak_scaling.py``: a barrier before every call, CUDA events, the slowest rank per repeat,
the median over repeats.  Rows go to JSON as they complete, then a PNG.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import dsl_variants as dv, results_io  # noqa: E402
from scaling_benchmarks import weak_scaling as ws  # noqa: E402

CPU_TOKENS, CPU_HEADS, CPU_DIM = 32, 2, 16  # the CPU smoke run's shard and widths


def _shard(args, rank: int, tokens: int):
    """The rank's tokens of every token tensor ``[B, T, ...]`` of ``args`` (others as
    they are)."""
    return {n: t[:, rank * tokens:(rank + 1) * tokens].contiguous() if torch.is_tensor(t)
            else t for n, t in args.items()}


def run_variant(name: str, *, group, strategy: str, device, tokens: int, heads: int, dim: int,
                warmup: int, repeats: int):
    """The two rows (``dsl``, ``builtin``) of one catalogue entry (rank 0's are written)."""
    import torch.distributed as dist

    from tests.dsl.catalogue import CATALOGUE

    P, r = dist.get_world_size(group), dist.get_rank(group)
    entry = CATALOGUE[name]
    v = entry.variant
    x = dv._inputs(entry, P * tokens, device.type, heads, dim)
    fn, kw = dv._builtin(entry, x)  # on the whole sequence: mapped token by token, then cut
    x, kw = _shard(x, r, tokens), _shard(kw, r, tokens)
    dsl_kw = dict(x, scale=dv.SCALE) if entry.state == "matrix" else dict(x)
    clock = ws.Clock(device)
    timings = {}
    for impl, call, args in (("dsl", v, dsl_kw), ("builtin", fn, kw)):
        for label, extra in (("shard", {}), ("sp", {"group": group, "strategy": strategy})):
            run = dv._fwd(call, dict(args, **extra))
            mine = ws.timed(lambda _clock, run=run: run(), clock, warmup=warmup,
                            repeats=repeats, group=group, device=device)
            timings[impl, label] = ws.reduce_ranks(ws._gather(mine, group))
    rows = []
    for impl in ("dsl", "builtin"):
        sp, shard = timings[impl, "sp"], timings[impl, "shard"]
        rows.append({"op": name, "impl": impl, "builtin": entry.builtin, "strategy": strategy,
                     "world_size": P, "tokens_per_gpu": tokens, "ms": sp["ms"],
                     "ms_min": sp["ms_min"], "shard_ms": shard["ms"],
                     "ratio": sp["ms"] / shard["ms"], "per_rank": sp["per_rank"]})
    dsl_row, builtin_row = rows
    dsl_row.update(path=dv.path_label(v), builtin_ratio=builtin_row["ratio"],
                   meets_target=dsl_row["ratio"] <= builtin_row["ratio"])
    return rows


def worker(args) -> int:
    import torch.distributed as dist

    from forge_dist import launch_env
    from forge_dist.sp import p2p

    info = launch_env.detect(use_mpi4py=False)
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(info.local_rank)
        device, backend = torch.device("cuda", info.local_rank), "nccl"
    bound = datetime.timedelta(seconds=p2p.timeout_seconds())  # every wait bounded
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=bound,
                            **({"device_id": device} if device.type == "cuda" else {}))
    control = dist.group.WORLD  # only this loop's agreement on how each variant went
    group = dist.new_group(list(range(dist.get_world_size())), timeout=bound)
    P, rank = dist.get_world_size(), dist.get_rank()
    tokens = args.T if not cpu else min(args.T, CPU_TOKENS)
    heads, dim = (args.heads, args.dim) if not cpu else (CPU_HEADS, CPU_DIM)
    warmup, repeats = (1, 2) if cpu else (3, args.repeats)
    result = results_io.header("dsl_variants_sp", {
        "B": dv.B, "H": heads, "K": dv.K, "V": dv.V, "D_vector": dim, "tokens_per_gpu": tokens,
        "dtype": "bfloat16", "pass": "fwd", "strategy": args.strategy, "warmup": warmup,
        "repeats": repeats}, world_size=P)
    if args.tag:
        result["tag"] = args.tag
    out_dir = Path(args.out) if args.out else None
    path = results_io.results_path(result, out_dir)
    if rank == 0:
        path = results_io.write(result, out_dir)
    for name in args.names:
        try:
            rows = run_variant(name, group=group, strategy=args.strategy, device=device,
                               tokens=tokens, heads=heads, dim=dim, warmup=warmup,
                               repeats=repeats)
        except Exception as e:  # noqa: BLE001 - recorded; the next variant runs
            traceback.print_exc()
            rows = [{"op": name, "impl": "dsl",
                     "skipped": f"rank {rank}: {type(e).__name__}: {e}"[:500]}]
        everyone = [None] * P
        dist.all_gather_object(everyone, rows, group=control)
        failed = [rs for rs in everyone if any("skipped" in row for row in rs)]
        if failed:  # a call raised on some rank and may have left collectives half done
            rows = failed[0]
            group = dist.new_group(list(range(P)), timeout=bound)
        if rank == 0:
            result["rows"].extend(rows)
            results_io.write(result, out_dir)
            for row in rows:
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                       if k != "per_rank"}, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        try:
            plot(result, path.with_suffix(".png"))
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e}", file=sys.stderr)
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("impl") == "dsl" and "ratio" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows)), 4.2))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["ratio"] for r in rows], width=0.4, label="DSL variant")
    ax.bar([i + 0.2 for i in xs], [r["builtin_ratio"] for r in rows], width=0.4,
           label="nearest built-in")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['op']}\n({r['path']})" for r in rows], rotation=75, fontsize=6)
    ax.set_ylabel("sequence-parallel / one shard")
    cfg = result["config"]
    ax.set_title(f"DSL catalogue, {result['world_size']} x {result['device']}, "
                 f"{cfg['tokens_per_gpu']} tokens per rank, {cfg['strategy']}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(args)


def main(args) -> int:
    """``args``: dsl_variants.py's parsed arguments (``--sp`` and the options it reads)."""
    from forge_dist import launch_env

    if launch_env.detect(use_mpi4py=False).source != "single":
        return worker(args)
    if args.device != "cpu" or args.world <= 1:
        print("dsl_variants.py --sp: run it under torchrun (one process per GPU), or on the "
              "CPU with --device cpu --world N (N >= 2)", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from forge_dist.selftest import free_port

    try:
        mp.start_processes(_spawned, args=(args.world, free_port(), args), nprocs=args.world,
                           join=True, start_method="spawn")
    except mp.ProcessExitedException as err:
        return err.exit_code or 1
    return 0

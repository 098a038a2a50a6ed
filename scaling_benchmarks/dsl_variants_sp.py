"""The catalogue of DSL variants sequence-parallel: what a variant adds over its one-shard time,
against what the nearest built-in op adds over its own.

Run by ``dsl_variants.py --sp`` under torchrun (one GPU per rank, NCCL), or on the CPU with
``--device cpu --world N`` (gloo processes, tiny shards: a check of the code path, not a timing).
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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import dsl_variants as dv, results_io, spmd  # noqa: E402
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
    world = spmd.start(args.device == "cpu")
    tokens = args.T if not world.cpu else min(args.T, CPU_TOKENS)
    heads, dim = (args.heads, args.dim) if not world.cpu else (CPU_HEADS, CPU_DIM)
    warmup, repeats = (1, 2) if world.cpu else (3, args.repeats)
    result = results_io.header("dsl_variants_sp", {
        "B": dv.B, "H": heads, "K": dv.K, "V": dv.V, "D_vector": dim, "tokens_per_gpu": tokens,
        "dtype": "bfloat16", "pass": "fwd", "strategy": args.strategy, "warmup": warmup,
        "repeats": repeats}, world_size=world.size)
    if args.tag:
        result["tag"] = args.tag

    def make_rows(name, group):
        return run_variant(name, group=group, strategy=args.strategy, device=world.device,
                           tokens=tokens, heads=heads, dim=dim, warmup=warmup, repeats=repeats)

    def failed_row(name, why):
        return {"op": name, "impl": "dsl", "skipped": why}
    spmd.run_rows(world, args.names, make_rows, failed_row, result,
                  Path(args.out) if args.out else None, plot)
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


def main(args) -> int:
    """``args``: dsl_variants.py's parsed arguments (``--sp`` and the options it reads)."""
    from forge_dist import launch_env

    if launch_env.detect(use_mpi4py=False).source == "single" and (
            args.device != "cpu" or args.world <= 1):
        print("dsl_variants.py --sp: run it under torchrun (one process per GPU), or on the "
              "CPU with --device cpu --world N (N >= 2)", file=sys.stderr)
        return 2
    return spmd.launch(worker, args, args.world)

"""Every layer of :mod:`forge_dist.nn` sequence-parallel, against the same layer on one shard.

Run by ``layers.py --sp`` under torchrun (one GPU per rank, NCCL), or on the CPU with
``--cpu --world N`` (gloo processes, fp32 or ``--cpu-dtype bfloat16``, tiny shards: a check
of the code path, not a timing).  Each rank holds the same layer (seeded initialisation) and the same global input
``x [B, P * tokens_per_gpu, hidden]``, and takes its shard of the sequence.  Per layer and
pass (``fwd`` under ``torch.no_grad``; ``fwdbwd``: forward + backward of ``(o * w).sum()``):

* ``shard_ms``: the layer on the rank's shard alone (no group), every rank at once;
* ``ms``: the layer on the rank's shard with the group (the ranks' sequence-parallel call);
* ``ratio = ms / shard_ms`` (the issue's target: <= 1.2 at 8192 tokens per GPU);
* ``max_rel_err``: the sequence-parallel output against the same layer on the whole
  sequence on one device (``max |a - b| / max |b|``), and for ``fwdbwd`` also over ``dx`` and
  every parameter gradient (the ranks' partial gradients summed in fp32, as
  :func:`forge_dist.nn.sum_gradients` does, so the sum adds no rounding of its own); the
  worst tensor, and the worst ``||a - b|| / ||b||`` as ``rms_rel_err``;
* with a 16-bit dtype, the same metric of both against the layer in fp32 (the same weights,
  the whole sequence, one device): ``sp_vs_fp32`` and ``one_device_vs_fp32``, the latter the
  noise the dtype itself leaves in one device's result, the floor the first is held to.

Times as in ``weak_scaling.py``: a barrier before every call, CUDA events, the slowest rank per
repeat, the median over repeats.  Rows go to JSON as they complete, then a PNG.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import layers as lb, results_io, spmd  # noqa: E402
from scaling_benchmarks import weak_scaling as ws  # noqa: E402

#: CPU smoke shapes: B, tokens per rank (the layers' widths stay FLA's at hidden 1024)
CPU_B, CPU_TOKENS = 1, 32


def build(name: str, device, dtype, group, strategy: str):
    """Our layer ``name`` at the shapes of :data:`layers.LAYERS`, seeded the same on every
    rank, holding ``group`` and ``strategy``."""
    from forge_dist import nn as fnn

    cls, _, kw = lb.LAYERS[name]
    torch.manual_seed(0)
    extra = {"num_layers": 4} if name == "lightning" else {}
    layer = fnn.__dict__[cls](layer_idx=1, group=group, strategy=strategy, **extra, **kw)
    return layer.to(device, dtype)


def _worst(errs):
    """The largest error, NaN if any is (``max`` would drop a NaN that does not come first)."""
    return float("nan") if any(e != e for e in errs) else max(errs)


def _rms_rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tensors(layer, x, out, grad):
    """``{name: tensor}`` a pass is judged on: the output, then (``grad``) ``dx`` and every
    parameter's gradient, detached copies."""
    got = {"out": out.detach()}
    if grad:
        got["dx"] = x.grad.detach().clone()
        got.update((f"d{n}", p.grad.detach().clone()) for n, p in sorted(layer.named_parameters())
                   if p.grad is not None)
    return got


def _errors(got, ref, metric):
    """``metric`` of each tensor of ``got`` against ``ref`` (the names both have)."""
    return {n: metric(t, ref[n]) for n, t in got.items() if n in ref}


def run_layer(name, pas, *, group, strategy, device, dtype, B, tokens, warmup, repeats):
    """The row of one layer and pass (rank 0's copy is the one written)."""
    import torch.distributed as dist

    P, r = dist.get_world_size(group), dist.get_rank(group)
    layer = build(name, device, dtype, group, strategy)
    hidden = lb.HIDDEN
    gen = torch.Generator(device=device).manual_seed(1)
    x_full = torch.randn(B, P * tokens, hidden, device=device, dtype=dtype, generator=gen)
    w_full = torch.randn(B, P * tokens, hidden, device=device, generator=gen)
    sl = slice(r * tokens, (r + 1) * tokens)
    grad = pas == "fwdbwd"
    x = x_full[:, sl].clone().requires_grad_(grad)
    w = w_full[:, sl]

    def whole(model, xs):  # the layer on the whole sequence, on this device alone
        xs = xs.detach().clone().requires_grad_(grad)
        out = lb._run(model, xs, w_full, pas, group=None)()
        got = _tensors(model, xs, out, grad)
        for n in ("out", "dx"):
            if n in got:
                got[n] = got[n][:, sl]
        return got

    ref = whole(layer, x_full)
    ref32 = None
    if dtype in (torch.bfloat16, torch.float16):  # the dtype's own noise on one device
        wide = build(name, device, torch.float32, None, strategy)
        wide.load_state_dict(layer.state_dict())  # the same weights, widened
        ref32 = whole(wide, x_full.float())
        wide = None
    x_full = None

    out = lb._run(layer, x, w, pas, group=group)()
    got = _tensors(layer, x, out, grad)
    for n, t in got.items():
        if n not in ("out", "dx"):  # a parameter's partial gradient: summed in fp32
            t32 = t.float()
            dist.all_reduce(t32, group=group)
            got[n] = t32
    errs = _errors(got, ref, lb._max_rel)
    worst = max(errs, key=lambda n: (errs[n] != errs[n], errs[n]))
    extra = {"worst_tensor": worst, "rms_rel_err": _worst(list(_errors(got, ref, _rms_rel)
                                                               .values()))}
    if ref32 is not None:
        extra["sp_vs_fp32"] = _worst(list(_errors(got, ref32, lb._max_rel).values()))
        extra["one_device_vs_fp32"] = _worst(list(_errors(ref, ref32, lb._max_rel).values()))
    errs = list(errs.values())
    ref = ref32 = out = got = None

    clock = ws.Clock(device)

    passes = {"shard": lb._run(layer, x, w, pas, group=None),
              "sp": lb._run(layer, x, w, pas, group=group)}
    timings = {}
    for label, run in passes.items():
        mine = ws.timed(lambda _clock, run=run: run(), clock, warmup=warmup, repeats=repeats,
                        group=group, device=device)
        timings[label] = ws.reduce_ranks(ws._gather(mine, group))
    mine = dict(extra, max_rel_err=_worst(errs))
    ranks = ws._gather(mine, group)
    # every error the worst over the ranks; the worst tensor that of the worst rank
    row_errs = {k: _worst([r[k] for r in ranks]) for k in mine if k != "worst_tensor"}
    row_errs["worst_tensor"] = max(ranks, key=lambda r: r["max_rel_err"])["worst_tensor"]
    row = {"layer": name, "pass": pas, "impl": "forge_dist", "strategy": layer.strategy,
           "world_size": P, "tokens_per_gpu": tokens, "ms": timings["sp"]["ms"],
           "ms_min": timings["sp"]["ms_min"], "shard_ms": timings["shard"]["ms"],
           "ratio": timings["sp"]["ms"] / timings["shard"]["ms"], **row_errs,
           "peak_mib": timings["sp"]["peak_mib"], "per_rank": timings["sp"]["per_rank"]}
    return row


def worker(args) -> int:
    world = spmd.start(args.cpu)
    dtype = getattr(torch, args.cpu_dtype) if world.cpu else torch.bfloat16
    B = CPU_B if world.cpu else lb.B
    tokens = args.tokens_per_gpu or (CPU_TOKENS if world.cpu else lb.T)
    warmup, repeats = (1, args.repeats or 2) if world.cpu else (3, args.repeats or 20)
    result = results_io.header("layers_sp", {
        "B": B, "tokens_per_gpu": tokens, "hidden": lb.HIDDEN, "dtype": str(dtype)[6:],
        "strategy": args.strategy, "warmup": warmup, "repeats": repeats,
        "layers": {n: lb.LAYERS[n][2] for n in lb.LAYERS}}, world_size=world.size)
    if args.tag:
        result["tag"] = args.tag
    items = [(name, pas) for name in args.layers.split(",") if name
             for pas in args.passes.split(",")]

    def make_rows(item, group):
        return [run_layer(*item, group=group, strategy=args.strategy, device=world.device,
                          dtype=dtype, B=B, tokens=tokens, warmup=warmup, repeats=repeats)]

    def failed_row(item, why):
        return {"layer": item[0], "pass": item[1], "impl": "forge_dist", "skipped": why}
    spmd.run_rows(world, items, make_rows, failed_row, result,
                  Path(args.out) if args.out else None, plot)
    return 0


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ratio" in r]
    names = list(dict.fromkeys(r["layer"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, pas in enumerate(("fwd", "fwdbwd")):
        ys = [next((r["ratio"] for r in rows if r["layer"] == n and r["pass"] == pas), 0.0)
              for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], ys, width=0.4, label=pas)
    ax.axhline(1.2, color="k", ls="--", lw=1, label="target 1.2x")
    ax.set_xticks([j + 0.2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=30, fontsize=8)
    ax.set_ylabel("sequence-parallel / one shard")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    cfg = result["config"]
    ax.set_title(f"layers, {result['world_size']} x {result['device']}, B={cfg['B']}, "
                 f"{cfg['tokens_per_gpu']} tokens per rank, {cfg['dtype']} (0: not run)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(args) -> int:
    """``args``: layers.py's parsed arguments (``--sp`` and the options it reads)."""
    from forge_dist import launch_env

    unknown = [n for n in args.layers.split(",") if n and n not in lb.LAYERS]
    if unknown:
        print(f"--layers: unknown {unknown}; choose from {list(lb.LAYERS)}", file=sys.stderr)
        return 2
    if launch_env.detect(use_mpi4py=False).source == "single":
        if args.world <= 1:
            print("layers.py --sp: run it under torchrun (one process per GPU), or on the CPU "
                  "with --cpu --world N (N >= 2)", file=sys.stderr)
            return 2
        if not args.cpu:
            print("layers.py --sp: --world spawns local processes; use torchrun for GPUs "
                  "(or pass --cpu)", file=sys.stderr)
            return 2
    return spmd.launch(worker, args, args.world)

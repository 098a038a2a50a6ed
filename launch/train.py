#!/usr/bin/env python
"""Train a small forge_dist LM on synthetic MQAR with sequence parallelism.

    torchrun --nproc_per_node 2 launch/train.py --sp 2 --config configs/train_mqar.toml
    python launch/train.py --sp 1                                   # one process, no torchrun
    torchrun --nproc_per_node 2 launch/train.py --sp 2 --set run.device=cpu   # CPU / gloo

World size must be a multiple of ``--sp``: ranks form a ``(dp, sp)`` DeviceMesh; each SP group
splits every sequence into contiguous shards, DP groups take different rows of the global
batch.  The loss is the mean over every labelled token of the global batch, and gradients are
summed over the whole world (one flat all-reduce), so the same seed gives the same training
run at any SP/DP split of the same global batch (up to floating-point reassociation).

Shows a progress bar (loss, recall accuracy, tokens/s) and writes ``<out_dir>/log.jsonl``
(one JSON object per logged step), ``<out_dir>/curves.png`` at the end (loss and accuracy
against the step; matplotlib), checkpoints ``<out_dir>/ckpt_<step>.pt`` and
``ckpt_latest.pt`` (model, optimizer, step, data RNG, config; rank-independent, so
``--resume`` works at another SP degree), and with ``--plot A.jsonl B.jsonl ...`` draws loss
curves (and the difference to the first) to a PNG.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(_ROOT))

from forge_dist import comm_env  # noqa: E402

comm_env.set_launch_defaults()  # before NCCL / NVSHMEM initialise

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from forge_dist import config as fconfig  # noqa: E402
from forge_dist.nn.model import ForgeLM, LMConfig, sum_gradients  # noqa: E402
from forge_dist.nn.mqar import MQAR  # noqa: E402

DEFAULTS: Dict = {
    "model": {k: v for k, v in LMConfig().__dict__.items() if k != "strategy"},
    "data": {"seq_len": 512, "num_kv_pairs": 16, "batch_size": 8, "seed": 0, "packed": False},
    "train": {"steps": 200, "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 20,
              "min_lr_ratio": 0.1, "grad_clip": 1.0, "seed": 0, "autocast": "none", "tf32": False,
              "log_every": 10, "ckpt_every": 0},
    "parallel": {"sp": 1, "strategy": "auto"},
    "run": {"out_dir": "runs/mqar", "device": "auto", "resume": ""},
}


# ----------------------------------------------------------------------------- process setup
class Dist:
    """World / SP / DP groups and this process's coordinates (all ``None`` for one process)."""

    def __init__(self, sp: int, device_pref: str):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if dist.is_initialized():
            world = dist.get_world_size()
        want_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if want_cuda:
            torch.cuda.set_device(local)  # before any NCCL / symmetric-memory setup
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if want_cuda else "gloo")
        if sp < 1 or world % sp:
            raise ValueError(f"--sp: the world size {world} must be a multiple of sp={sp}")
        self.world, self.sp, self.dp = world, sp, world // sp
        self.rank = dist.get_rank() if world > 1 else 0
        self.world_group = dist.group.WORLD if world > 1 else None
        self.sp_group = self.dp_group = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(self.device.type, (self.dp, self.sp),
                                    mesh_dim_names=("dp", "sp"))
            if self.sp > 1:
                self.sp_group = mesh.get_group("sp")
            if self.dp > 1:
                self.dp_group = mesh.get_group("dp")
        self.sp_rank = dist.get_rank(self.sp_group) if self.sp_group is not None else 0
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0


def shard(ids, labels, cu, d: Dist, batch_size: int):
    """This rank's rows (DP) and contiguous token shard (SP) of the global batch."""
    if cu is not None and d.dp > 1:
        raise ValueError("data.packed needs dp == 1 (one packed row per step)")
    rows = ids.shape[0] // d.dp
    r0 = d.dp_rank * rows
    T = ids.shape[1]
    if T % d.sp:
        raise ValueError(f"sequence length {T} must be a multiple of sp={d.sp}")
    t = T // d.sp
    t0 = d.sp_rank * t
    return (ids[r0:r0 + rows, t0:t0 + t], labels[r0:r0 + rows, t0:t0 + t])


def lr_at(step: int, cfg: Dict) -> float:
    tr = cfg["train"]
    if step < tr["warmup_steps"]:
        return tr["lr"] * (step + 1) / tr["warmup_steps"]
    span = max(1, tr["steps"] - tr["warmup_steps"])
    frac = min(1.0, (step - tr["warmup_steps"]) / span)
    floor = tr["min_lr_ratio"]
    return tr["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: torch.nn.Module, cfg: Dict) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # fixed order: same state dict on every rank
        plain = p.dim() < 2 or getattr(p, "_no_weight_decay", False) or "norm" in name
        (no_decay if plain else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg["train"]["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg["train"]["lr"], betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, model, opt, step: int, data: MQAR, cfg: Dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "data": data.state_dict(), "config": cfg}, tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ train
def train(cfg: Dict, *, on_grads: Optional[Callable[[int, List[torch.Tensor]], None]] = None,
          echo: bool = True) -> List[Dict]:
    """Run the training described by ``cfg``; returns the per-step records (every rank).

    ``on_grads(step, grads)`` sees the summed (global) gradients before clipping (tests).
    """
    d = Dist(cfg["parallel"]["sp"], cfg["run"]["device"])
    tr, dc = cfg["train"], cfg["data"]
    if echo and d.rank == 0:  # a first line before the model is built and the kernels load
        m = cfg["model"]
        print(f"MQAR: {m['num_layers']} layers ({m['mixer']}) of width {m['hidden_size']}, "
              f"{dc['batch_size']} x {dc['seq_len']} tokens with {dc['num_kv_pairs']} pairs a "
              f"step, {tr['steps']} steps on {d.device} (sp={d.sp}, dp={d.dp}); "
              f"writing {cfg['run']['out_dir']}", flush=True)
    # TF32 (cuDNN convs default to it) adds ~1e-3 noise that differs between shard shapes;
    # keep it off for SP-vs-SP=1 comparisons.
    torch.backends.cuda.matmul.allow_tf32 = tr["tf32"]
    torch.backends.cudnn.allow_tf32 = tr["tf32"]
    torch.manual_seed(tr["seed"])  # identical initial parameters on every rank
    mcfg = LMConfig(**cfg["model"], strategy=cfg["parallel"]["strategy"])
    model = ForgeLM(mcfg).to(d.device)
    opt = make_optimizer(model, cfg)
    data = MQAR(mcfg.vocab_size, dc["seq_len"], dc["num_kv_pairs"], dc["seed"], dc["packed"])
    if dc["batch_size"] % d.dp:
        raise ValueError(f"data.batch_size={dc['batch_size']} must be a multiple of dp={d.dp}")
    out = Path(cfg["run"]["out_dir"])
    start = 0
    if cfg["run"]["resume"]:
        ck = torch.load(cfg["run"]["resume"], map_location=d.device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        data.load_state_dict(ck["data"])
        start = ck["step"]
    params = list(model.parameters())
    log_file = None
    if d.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log_file = open(out / "log.jsonl", "a" if start else "w")
    amp = {"none": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[tr["autocast"]]
    records = []
    tokens_per_step = dc["batch_size"] * dc["seq_len"]
    bar = None
    if echo and d.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=tr["steps"], initial=start, unit="step", file=sys.stderr,
                   dynamic_ncols=True)
    # wall time of this process's run, compilation included (a resumed run starts again at 0)
    began = time.perf_counter()
    try:
        for step in range(start, tr["steps"]):
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ids, labels, cu = data.batch(dc["batch_size"])
            ids, labels = shard(ids, labels, cu, d, dc["batch_size"])
            ids, labels = ids.to(d.device), labels.to(d.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                res = model(ids, labels, cu_seqlens=None if cu is None else cu.to(d.device),
                            group=d.sp_group, loss_group=d.world_group)
            res.loss.backward()
            sum_gradients(params, d.world_group)
            if on_grads is not None:
                on_grads(step, [p.grad for p in params])
            gnorm = torch.nn.utils.clip_grad_norm_(params, tr["grad_clip"] or float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rec = {"step": step + 1, "loss": res.loss.item(),
                   "acc": (res.num_correct.float() / res.num_tokens.clamp_min(1)).item(),
                   "grad_norm": gnorm.item(), "lr": lr_at(step, cfg),
                   "tokens_per_s": tokens_per_step / dt, "step_s": dt,
                   "elapsed_s": time.perf_counter() - began,
                   "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2 ** 30
                                    if d.device.type == "cuda" else None),
                   "sp": d.sp, "dp": d.dp, "world": d.world}
            records.append(rec)
            last = step + 1 == tr["steps"]
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}",
                                tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
            if d.rank == 0 and (last or (step + 1) % tr["log_every"] == 0 or step == start):
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                if bar is not None:
                    mem = "" if rec["peak_mem_gib"] is None else f" mem {rec['peak_mem_gib']:.2f}GiB"
                    bar.write(f"step {rec['step']:5d} loss {rec['loss']:.6f} acc {rec['acc']:.3f} "
                              f"tok/s {rec['tokens_per_s']:.0f}{mem}")
            every = tr["ckpt_every"]
            if d.rank == 0 and ((every and (step + 1) % every == 0) or (last and every)):
                save_checkpoint(out / f"ckpt_{step + 1}.pt", model, opt, step + 1, data, cfg)
                save_checkpoint(out / "ckpt_latest.pt", model, opt, step + 1, data, cfg)
    finally:
        if bar is not None:
            bar.close()
        if log_file is not None:
            log_file.close()
    if d.rank == 0 and echo:
        curves(out / "log.jsonl", out / "curves.png")
    if d.world > 1:
        dist.barrier()  # checkpoints complete before anyone reads them
    return records


# ------------------------------------------------------------------------------------- plot
def curves(log: Path, out_png: Path) -> Optional[Path]:
    """One run's loss and recall accuracy against the step (from its ``log.jsonl``) to a
    PNG; ``None`` (and a line saying why) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"curves: matplotlib is not installed; the curves are in {log}")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax.plot(steps, [r["loss"] for r in rows])
    ax.set_ylabel("MQAR loss (answer tokens)")
    ax2.plot(steps, [r["acc"] for r in rows])
    ax2.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax2.set_ylabel("recall accuracy")
    ax2.set_xlabel("step")
    ax.set_title(f"{_run_name(log)}: sp={rows[-1]['sp']}, world={rows[-1]['world']}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    print(f"wrote {out_png}")
    return Path(out_png)


def _run_name(log) -> str:
    """A run's name in a plot: its folder's for a run's ``log.jsonl``, else the file's stem."""
    log = Path(log)
    return log.parent.name if log.name == "log.jsonl" else log.stem


def plot(paths: List[str], out_png: str) -> None:
    """Loss vs step for each JSONL log, and each curve's relative difference to the first."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for p in paths:
        with open(p) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        runs.append((p, {r["step"]: r for r in rows}))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    base = runs[0][1]
    for p, rows in runs:
        steps = sorted(rows)
        r0 = next(iter(rows.values()))
        label = f"{_run_name(p)} (sp={r0['sp']}, world={r0['world']})"
        ax.plot(steps, [rows[s]["loss"] for s in steps], label=label)
        common = [s for s in steps if s in base]
        ax2.semilogy(common, [abs(rows[s]["loss"] - base[s]["loss"]) / abs(base[s]["loss"])
                              + 1e-12 for s in common], label=label)
    ax.set_ylabel("MQAR loss (answer tokens)")
    ax.legend()
    ax2.set_ylabel(f"|loss - loss[{_run_name(paths[0])}]| / loss")
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    print(f"wrote {out_png}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fconfig.add_arguments(ap)
    ap.add_argument("--sp", type=int, default=None, help="sequence-parallel degree")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--resume", default=None, help="checkpoint to continue from (any SP)")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSONL",
                    help="only draw the loss curves of these logs (first = baseline)")
    ap.add_argument("--plot-out", default="loss_compare.png")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot, args.plot_out)
        return 0
    cfg = fconfig.load(DEFAULTS, args.config, args.overrides)
    if args.sp is not None:
        cfg["parallel"]["sp"] = args.sp
    if args.steps is not None:
        cfg["train"]["steps"] = args.steps
    if args.out_dir is not None:
        cfg["run"]["out_dir"] = args.out_dir
    if args.resume is not None:
        cfg["run"]["resume"] = args.resume
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

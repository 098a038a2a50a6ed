"""Longest sequence that trains one Gated DeltaNet layer (forward + backward) on N GPUs.

One ``forge_dist.nn.GatedDeltaNet`` layer (bf16 weights and activations), sequence-parallel
over every rank: rank r holds tokens ``[r * T/N, (r+1) * T/N)`` of ``x [1, T/N, hidden]``.
For each total length ``T`` in turn the script runs ``warmup + repeats`` training steps
(forward, then backward with a fixed random upstream gradient ``dL/do``; ``x`` requires a
gradient like any layer inside a model) and stops at the first length that fails on any
rank.

Launch one process per GPU (NCCL)::

    torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py
    torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py --lengths 1M 2M 4M \\
        --strategy lasp2 --checkpoint --set repeats=3

or on the CPU with gloo at tiny shapes (spawns ``--world`` processes itself; hidden 32,
2 heads of 16, lengths 64 and 128, fp32)::

    python scaling_benchmarks/long_sequence.py --cpu --world 2

Defaults: hidden_size=1024, num_heads=8, head_dim=128, expand_v=1 (so H=8, K=V=128),
strategy ``lasp2``, lengths doubling from 256K to 8M tokens (K = 1024, M = 1024**2).  Every
setting is a config key (``--config FILE``, ``--set key=value``); ``--lengths``,
``--strategy`` and ``--checkpoint`` are shortcuts for three of them.

What each number means (one row per total length ``T``)
---------------------------------------------------------
* ``outcome`` -- ``ok`` when every rank finished every step; otherwise the first failing
  rank's outcome: ``oom`` (``torch.cuda.OutOfMemoryError`` or an "out of memory" error from
  NCCL/cuBLAS), ``timeout`` (a bounded wait for a peer expired), ``error`` (anything else,
  message in ``error``), ``no_report`` (a rank never reported: it was stuck or killed).
  ``incomplete`` marks the length in progress while it runs, so a file from a killed job
  shows where it died.  Per rank, ``stopped`` means that rank was fine but a peer failed.
* ``ms`` -- one training step (layer forward + backward, parameter gradients and ``dL/dx``
  included), CUDA events on the current stream (``perf_counter`` on the CPU), taken per
  repeat as the maximum over ranks (the step waits for its slowest rank), then the median
  over ``repeats`` timed steps after ``warmup`` untimed ones; ``ms_min`` the fastest repeat.
* ``tokens_per_s`` -- ``T / (ms / 1000)``: tokens of the whole sequence per second.
* ``peak_gib`` -- ``torch.cuda.max_memory_allocated`` on each rank from the start of this
  length (inputs, upstream gradient, activations, gradients, the backward's recomputation;
  the allocator's cache is emptied between lengths), GiB; the row holds the maximum over
  ranks, ``per_rank`` each rank's value and ``peak_reserved_gib`` (what the caching allocator
  held, fragmentation included).  ``None`` on the CPU.  For a failed length it is the peak
  reached before the failure.
* ``max_tokens_trained`` -- the largest ``T`` whose row is ``ok`` (0 if none).

``--checkpoint`` wraps the layer in ``torch.utils.checkpoint`` (non-reentrant, no early
stop, so every rank replays the layer's collectives in the same order).  For a single layer
the recomputed forward restores its activations right before that layer's backward, so the
peak barely moves; the row shows what each layer of a checkpointed stack would cost.

Robustness: the process group gets ``timeout_s`` (NCCL's watchdog bound),
``FORGE_DIST_TIMEOUT`` = ``pass_timeout_s`` bounds the library's own waits, and the ranks
agree on every step's go-ahead and every length's outcome over a private gloo group (host
side, bounded by ``timeout_s``, independent of the NCCL stream), so a rank that fails never
leaves its peers in a mismatched collective of ours.  A rank that fails writes the results
file at once (with its own outcome) before waiting for the others; if a peer was stuck
inside one of the layer's NCCL collectives it cannot leave, NCCL's watchdog ends it after
``timeout_s`` and the file already says what happened.

Output: ``<out>/long_sequence_<device>x<N>_<date>_<strategy>[_ckpt].json`` (the
results_io header: benchmark, device, world_size, torch, triton, commit, date, config,
rows; plus ``max_tokens_trained``, ``stopped_at``, ``device_total_gib``) rewritten after
every length, a table on stdout and a PNG beside the JSON (peak GiB and step ms vs tokens).
"""
from __future__ import annotations

import os

# NVLink multicast stays off on shared hosts (forge_dist.comm_env.LAUNCH_DEFAULTS); set before
# anything can start NCCL or NVSHMEM.  Values the user exported are kept.
for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_dist import config as cfg_mod  # noqa: E402
from forge_dist import launch_env  # noqa: E402
from scaling_benchmarks import results_io  # noqa: E402

BENCHMARK = "long_sequence"
STRATEGIES = ("lasp2", "forge", "serial", "pipelined")
GIB = 2 ** 30

DEFAULTS: Dict[str, Any] = {
    "hidden_size": 1024,
    "num_heads": 8,
    "head_dim": 128,            # K; V = head_dim * expand_v
    "expand_v": 1.0,
    "dtype": "bfloat16",        # weights, x and dL/do
    "strategy": "lasp2",
    "lengths": [2 ** 18 * 2 ** i for i in range(6)],  # 256K ... 8M total tokens
    "checkpoint": False,        # torch.utils.checkpoint around the layer (recompute forward)
    "warmup": 1,
    "repeats": 2,
    "seed": 0,
    "cpu": False,               # gloo on the CPU
    "world": 1,                 # processes to spawn when not under a launcher (CPU runs)
    "timeout_s": 180,           # process groups (NCCL watchdog, the gloo control group)
    "pass_timeout_s": 180,      # FORGE_DIST_TIMEOUT: the library's bounded waits
    "out": "",                  # results folder; "" = scaling_benchmarks/results
    "plot": True,
}

CPU_DEFAULTS: Dict[str, Any] = {"hidden_size": 32, "num_heads": 2, "head_dim": 16,
                                "dtype": "float32", "lengths": [64, 128], "cpu": True,
                                "timeout_s": 60, "pass_timeout_s": 30}

#: Per-rank outcomes, worst first: the row takes the worst failing rank's outcome.
FAILURES = ("oom", "timeout", "error", "no_report")


# ------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------

def parse_length(text: str) -> int:
    """``"4M"`` -> 4194304, ``"256K"`` -> 262144, ``"4096"`` -> 4096 (binary suffixes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"length: expected a number with an optional K/M/G suffix, got "
                         f"{text!r}")
    return int(m.group(1)) * {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}[m.group(2).lower()]


def human_tokens(n: int) -> str:
    """262144 -> ``256K``, 4194304 -> ``4M``, 1000 -> ``1000``."""
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def describe_error(err: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    lines = f"{type(err).__name__}: {err}".strip().splitlines()
    return lines[0][:400] if lines else type(err).__name__


def classify_error(err: BaseException) -> str:
    """``oom``, ``timeout`` or ``error``."""
    text = str(err).lower()
    if isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in text \
            or "alloc_failed" in text:
        return "oom"
    from forge_dist.sp import StatePassTimeout

    if isinstance(err, StatePassTimeout) or "timed out" in text or "timeout" in text:
        return "timeout"
    return "error"


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype name such as bfloat16, got {name!r}")
    return dt


class ControlError(RuntimeError):
    """The gloo control group failed: a peer timed out, crashed or left."""


class Control:
    """Host-side agreement between ranks over a private gloo group, bounded by its timeout.

    Separate from the layer's process group, so our agreements can never pair with one of
    the layer's collectives that a failed rank left half-done.
    """

    def __init__(self, world_size: int, timeout_s: float):
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout_s))

    def all_ok(self, ok: bool) -> bool:
        """True on every rank only if ``ok`` on every rank."""
        if self.group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as err:
            raise ControlError(describe_error(err)) from err
        return bool(flag.item())

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        out: List[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as err:
            raise ControlError(describe_error(err)) from err
        return out


class StepTimer:
    """Milliseconds of one step: CUDA events on the current stream, or ``perf_counter``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop_ms(self) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return float(self._start.elapsed_time(end))
        return (time.perf_counter() - self._t0) * 1e3


# ------------------------------------------------------------------------------------------
# the layer and one length
# ------------------------------------------------------------------------------------------

def build_layer(cfg, group, device: torch.device) -> torch.nn.Module:
    """The same weights on every rank (seeded), in ``cfg.dtype`` on ``device``."""
    from forge_dist.nn import GatedDeltaNet

    torch.manual_seed(int(cfg["seed"]))
    layer = GatedDeltaNet(hidden_size=int(cfg["hidden_size"]), num_heads=int(cfg["num_heads"]),
                          head_dim=int(cfg["head_dim"]), expand_v=float(cfg["expand_v"]),
                          group=group, strategy=cfg["strategy"])
    return layer.to(device=device, dtype=torch_dtype(cfg["dtype"]))


def training_step(layer: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor,
                  checkpoint: bool) -> None:
    """Forward, then backward with ``upstream`` as ``dL/do``; gradients start from None."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    if checkpoint:
        from torch.utils import checkpoint as ckpt

        # Recompute the whole forward in backward on every rank (no early stop), so every
        # rank replays the layer's collectives in the same order.
        with ckpt.set_checkpoint_early_stop(False):
            o = ckpt.checkpoint(layer, x, use_reentrant=False)[0]
    else:
        o = layer(x)[0]
    o.backward(upstream)


def rank_report(rank: int, outcome: str = "ok", error: Optional[str] = None) -> Dict[str, Any]:
    return {"rank": rank, "outcome": outcome, "error": error, "ms": [],
            "peak_alloc_gib": None, "peak_reserved_gib": None}


def attempt_length(T_total: int, layer, cfg, device: torch.device, rank: int, world: int,
                   control: Control, on_failure: Callable[[Dict[str, Any]], None]):
    """Run the steps of one length on this rank; ``(this rank's report, control ok)``.

    Every step starts with an agreement (all ranks still fine?), so a rank that failed in
    step i makes all ranks stop before step i + 1 instead of waiting in its collectives.
    """
    T_local = T_total // world
    steps = int(cfg["warmup"]) + int(cfg["repeats"])
    report = rank_report(rank)
    timer = StepTimer(device)
    dtype = torch_dtype(cfg["dtype"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    x = upstream = None

    def fail(err: BaseException) -> None:
        report.update(outcome=classify_error(err), error=describe_error(err))
        print(f"{BENCHMARK}: rank {rank}: T={T_total}: {report['error']}", file=sys.stderr,
              flush=True)

    try:
        torch.manual_seed(int(cfg["seed"]) * 7919 + 1 + rank)  # a different shard per rank
        x = torch.randn(1, T_local, int(cfg["hidden_size"]), device=device, dtype=dtype)
        x.requires_grad_(True)
        upstream = torch.randn_like(x)  # the layer's output has x's shape
    except Exception as err:  # noqa: BLE001 - every failure becomes a reported outcome
        fail(err)
    control_ok = True
    try:
        for step in range(steps + 1):
            failed_here = report["outcome"] != "ok"
            if failed_here:
                _record_peak(report, device)
                on_failure(report)  # write the file before waiting on the peers
            if not control.all_ok(not failed_here) or step == steps:
                break
            try:
                timer.start()
                training_step(layer, x, upstream, bool(cfg["checkpoint"]))
                ms = timer.stop_ms()
                if step >= int(cfg["warmup"]):
                    report["ms"].append(ms)
            except Exception as err:  # noqa: BLE001
                fail(err)
    except ControlError as err:
        control_ok = False
        report["error"] = report["error"] or f"control group: {err}"
    if report["outcome"] == "ok" and len(report["ms"]) < int(cfg["repeats"]):
        report["outcome"] = "stopped"  # a peer failed first
    _record_peak(report, device)
    # Drop our references.  The next length empties the allocator's cache; after a failure
    # there is no next length, and no empty_cache here either: a collective of the layer may
    # still sit on the stream, and cudaFree would wait for it.
    del x, upstream
    for p in layer.parameters():
        p.grad = None
    return report, control_ok


def _record_peak(report: Dict[str, Any], device: torch.device) -> None:
    if device.type == "cuda":  # allocator statistics: host side, no synchronisation
        report["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        report["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB


def length_row(T_total: int, cfg, world: int, reports: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The results row of one length from the ranks' reports (missing ranks: no_report)."""
    by_rank = {r["rank"]: r for r in reports}
    per_rank = [by_rank.get(r, rank_report(r, "no_report", "did not report (stuck or "
                                                             "killed)")) for r in range(world)]
    failed = [r for r in per_rank if r["outcome"] in FAILURES]
    outcome = "ok"
    error = None
    if failed:
        worst = min(failed, key=lambda r: (FAILURES.index(r["outcome"]), r["rank"]))
        outcome, error = worst["outcome"], f"rank {worst['rank']}: {worst['error']}"
    elif any(r["outcome"] != "ok" for r in per_rank):
        outcome, error = "error", "a rank stopped without a failing peer"
    row = {"op": "gated_delta_rule", "layer": "GatedDeltaNet", "pass": "fwdbwd",
           "impl": "forge_dist", "strategy": cfg["strategy"], "checkpoint": bool(cfg["checkpoint"]),
           "world_size": world, "T": T_total, "tokens_per_rank": T_total // world,
           "outcome": outcome, "error": error,
           "failed_ranks": [r["rank"] for r in failed],
           "ms": None, "ms_min": None, "tokens_per_s": None, "peak_gib": None,
           "per_rank": [{"rank": r["rank"], "outcome": r["outcome"], "error": r["error"],
                         "ms": statistics.median(r["ms"]) if r["ms"] else None,
                         "ms_repeats": r["ms"], "peak_gib": r["peak_alloc_gib"],
                         "peak_reserved_gib": r["peak_reserved_gib"]} for r in per_rank]}
    if outcome == "ok":
        n = min(len(r["ms"]) for r in per_rank)
        step_ms = [max(r["ms"][i] for r in per_rank) for i in range(n)]
        row["ms"], row["ms_min"] = statistics.median(step_ms), min(step_ms)
        row["tokens_per_s"] = T_total / (row["ms"] / 1e3)
    peaks = [r["peak_alloc_gib"] for r in per_rank if r["peak_alloc_gib"] is not None]
    row["peak_gib"] = max(peaks) if peaks else None
    return row


# ------------------------------------------------------------------------------------------
# results file, table, figure
# ------------------------------------------------------------------------------------------

class Results:
    """The results dict (identical on every rank) and its file."""

    def __init__(self, cfg, device: torch.device, world: int):
        self.data = results_io.header(BENCHMARK, public_config(cfg, device), world)
        if device.type != "cuda":
            self.data["device"] = "cpu"
        self.data["device_total_gib"] = (
            torch.cuda.get_device_properties(device).total_memory / GIB
            if device.type == "cuda" else None)
        self.data.update(max_tokens_trained=0, stopped_at=None, setup_error=None)
        out_dir = Path(cfg["out"]) if cfg["out"] else results_io.RESULTS_DIR
        base = results_io.results_path({**self.data, "device": f"{self.data['device']}x{world}"},
                                       out_dir)
        suffix = f"_{cfg['strategy']}" + ("_ckpt" if cfg["checkpoint"] else "")
        self.path = base.with_name(f"{base.stem}{suffix}{base.suffix}")

    def set_row(self, row: Dict[str, Any]) -> None:
        """Add ``row``, replacing an earlier row of the same length."""
        rows = [r for r in self.data["rows"] if r["T"] != row["T"]]
        rows.append(row)
        self.data["rows"] = rows
        ok = [r["T"] for r in rows if r["outcome"] == "ok"]
        self.data["max_tokens_trained"] = max(ok) if ok else 0
        failed = [r for r in rows if r["outcome"] not in ("ok", "incomplete")]
        self.data["stopped_at"] = ({"T": failed[0]["T"], "outcome": failed[0]["outcome"],
                                    "error": failed[0]["error"]} if failed else None)

    def write(self, reported_by: int) -> Path:
        """Atomic rewrite (several ranks may write after a failure; the last one wins)."""
        self.data["reported_by_rank"] = reported_by
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{reported_by}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)
        return self.path


def public_config(cfg, device: torch.device) -> Dict[str, Any]:
    c = {k: v for k, v in cfg.items() if k not in ("out", "world", "plot")}
    head_v = int(round(float(cfg["head_dim"]) * float(cfg["expand_v"])))
    c.update(H=int(cfg["num_heads"]), K=int(cfg["head_dim"]), V=head_v, B=1,
             backend="nccl" if device.type == "cuda" else "gloo",
             loss="o.backward(dL/do), dL/do ~ N(0, 1) in dtype; x requires grad")
    return c


def progress_line(row: Dict[str, Any]) -> str:
    peak = f"peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "peak -"
    if row["outcome"] == "ok":
        return (f"{BENCHMARK}: T={human_tokens(row['T'])} ({row['tokens_per_rank']}/rank) ok "
                f"{row['ms']:.1f} ms  {row['tokens_per_s'] / 1e3:.1f}K tok/s  {peak}")
    return (f"{BENCHMARK}: T={human_tokens(row['T'])} ({row['tokens_per_rank']}/rank) "
            f"{row['outcome'].upper()}  {peak}  {row['error']}")


def print_table(data: Dict[str, Any]) -> None:
    c = data["config"]
    print(f"\n{BENCHMARK}: GatedDeltaNet hidden={c['hidden_size']} H={c['H']} K={c['K']} "
          f"V={c['V']} {c['dtype']}, {data['world_size']} x {data['device']}, strategy "
          f"{c['strategy']}, checkpoint {c['checkpoint']}")
    print(f"{'tokens':>11}{'per rank':>11}  {'outcome':<11}{'step ms':>10}{'tok/s':>12}"
          f"{'peak GiB':>10}")
    for r in data["rows"]:
        ms = f"{r['ms']:10.1f}" if r["ms"] is not None else f"{'-':>10}"
        tps = f"{r['tokens_per_s']:12.0f}" if r["tokens_per_s"] is not None else f"{'-':>12}"
        peak = f"{r['peak_gib']:10.2f}" if r["peak_gib"] is not None else f"{'-':>10}"
        print(f"{r['T']:>11}{r['tokens_per_rank']:>11}  {r['outcome']:<11}{ms}{tps}{peak}")
    print(f"max_tokens_trained: {data['max_tokens_trained']} "
          f"({human_tokens(data['max_tokens_trained'])})", flush=True)


def plot(data: Dict[str, Any], png: Path) -> Path:
    """Peak GiB and step ms against total tokens; the failed length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [r for r in data["rows"] if r["outcome"] == "ok"]
    fig, (ax_mem, ax_ms) = plt.subplots(1, 2, figsize=(9, 3.4))
    xs = [r["T"] for r in ok]
    if any(r["peak_gib"] is not None for r in ok):
        ax_mem.plot(xs, [r["peak_gib"] for r in ok], "o-")
    else:
        ax_mem.text(0.5, 0.5, "no CUDA memory statistics", transform=ax_mem.transAxes,
                    ha="center", fontsize=8)
    if data.get("device_total_gib"):
        ax_mem.axhline(data["device_total_gib"], color="k", ls="--", lw=1, label="device")
        ax_mem.legend(fontsize=7)
    ax_ms.plot(xs, [r["ms"] for r in ok], "o-")
    for ax, label in ((ax_mem, "peak GiB (max over ranks)"), (ax_ms, "step ms (fwd+bwd)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: human_tokens(int(round(v)))))
        ax.set_xlabel("total tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if data.get("stopped_at"):
            ax.axvline(data["stopped_at"]["T"], color="r", ls=":", lw=1)
            ax.text(data["stopped_at"]["T"], ax.get_ylim()[1], data["stopped_at"]["outcome"],
                    color="r", fontsize=7, ha="right", va="top")
    c = data["config"]
    fig.suptitle(f"GatedDeltaNet fwd+bwd, {data['world_size']} x {data['device']}, "
                 f"{c['strategy']}{' + checkpoint' if c['checkpoint'] else ''}, max "
                 f"{human_tokens(data['max_tokens_trained'])} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------------
# per-rank entry
# ------------------------------------------------------------------------------------------

def setup_strategy(cfg, device: torch.device, world: int) -> Optional[str]:
    """Why ``cfg.strategy`` cannot run here (``None`` if it can); forge: NVSHMEM set up."""
    if world == 1:
        return None
    from forge_dist import sp

    name = cfg["strategy"]
    if name == "forge" and "forge" not in sp.names():
        return f"strategy 'forge' is not registered: {sp.FORGE_IMPORT_ERROR}"
    try:
        sp.resolve(name, device)
        if name == "forge":  # NVSHMEM initialises in its first symmetric allocation
            from forge_dist.comm import nvshmem

            nvshmem.setup(dist.group.WORLD)
    except Exception as err:  # noqa: BLE001
        return describe_error(err)
    return None


def worker(cfg) -> Results:
    """The per-rank entry (under torchrun/srun, or spawned for CPU runs)."""
    os.environ.setdefault("FORGE_DIST_TIMEOUT", str(cfg["pass_timeout_s"]))
    info, device = launch_env.init_device_world(cpu=cfg["cpu"], timeout_s=float(cfg["timeout_s"]))
    rank, world = info.rank, info.world_size
    group = dist.group.WORLD if world > 1 else None
    try:
        control = Control(world, float(cfg["timeout_s"]))
        results = Results(cfg, device, world)
        layer = None
        reason = setup_strategy(cfg, device, world)
        if reason is None:
            try:
                layer = build_layer(cfg, group, device)
            except Exception as err:  # noqa: BLE001
                reason = describe_error(err)
        reasons = [r for r in control.gather(reason) if r]
        if reasons:
            results.data["setup_error"] = reasons[0]
            if rank == 0:
                results.write(rank)
                print(f"{BENCHMARK}: setup failed: {reasons[0]}", file=sys.stderr, flush=True)
            return results
        sweep(cfg, layer, device, rank, world, control, results)
        return results
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sweep(cfg, layer, device, rank: int, world: int, control: Control, results: Results):
    """Every length in turn, until the first one that fails on any rank.

    Rank 0 writes the file and prints; when the control group broke (a peer is stuck or
    gone) every surviving rank does, since nobody can tell whether rank 0 is still there.
    """
    reporter = rank == 0
    for T_total in [int(t) for t in cfg["lengths"]]:
        results.set_row({"T": T_total, "tokens_per_rank": T_total // world,
                         "outcome": "incomplete", "error": None, "ms": None,
                         "tokens_per_s": None, "peak_gib": None})
        if reporter:
            results.write(rank)
            print(f"{BENCHMARK}: T={human_tokens(T_total)} ({T_total // world}/rank) ...",
                  flush=True)

        def on_failure(report, T_total=T_total):
            results.set_row(length_row(T_total, cfg, world, [report]))
            results.write(rank)

        report, control_ok = attempt_length(T_total, layer, cfg, device, rank, world,
                                            control, on_failure)
        reports = [report]
        if control_ok:
            try:
                reports = control.gather(report)
            except ControlError as err:
                control_ok = False
                report["error"] = report["error"] or f"control group: {err}"
        reporter = reporter or not control_ok
        row = length_row(T_total, cfg, world, reports)
        results.set_row(row)
        if reporter:
            results.write(rank)
            print(progress_line(row), flush=True)
        if row["outcome"] != "ok":
            break
    if reporter:
        print(f"{BENCHMARK}: wrote {results.path}", file=sys.stderr, flush=True)
        print_table(results.data)
        if cfg["plot"]:
            try:
                plot(results.data, results.path.with_suffix(".png"))
            except Exception as err:  # noqa: BLE001 - the JSON is the result
                print(f"{BENCHMARK}: plot failed: {describe_error(err)}", file=sys.stderr)


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------

def _spawned(rank: int, world: int, port: int, cfg) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if worker(cfg).data["setup_error"]:
        sys.exit(1)


def parse(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="long_sequence.py", description=__doc__.split("\n")[0])
    cfg_mod.add_arguments(p)
    p.add_argument("--lengths", nargs="+", default=None, metavar="T",
                   help="total tokens to try, in order (suffixes K/M/G = 2**10/20/30; "
                        "commas allowed), e.g. --lengths 1M 2M 4M")
    p.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="inter-rank state pass (config key 'strategy', default lasp2)")
    p.add_argument("--checkpoint", action="store_true",
                   help="wrap the layer in torch.utils.checkpoint (recompute the forward)")
    p.add_argument("--cpu", action="store_true",
                   help="gloo on the CPU at tiny shapes (hidden 32, 2 heads of 16, fp32)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn when not launched by torchrun/srun/mpirun")
    p.add_argument("--out", default=None, help="results folder (config key 'out')")
    args = p.parse_args(argv)
    defaults = dict(DEFAULTS)
    if args.cpu:
        defaults.update(CPU_DEFAULTS)
    try:
        cfg = cfg_mod.load(defaults, args.config, args.overrides)
        if args.lengths is not None:
            cfg["lengths"] = [parse_length(t) for item in args.lengths
                              for t in item.split(",") if t.strip()]
        else:
            cfg["lengths"] = [parse_length(str(t)) for t in cfg["lengths"]]
    except ValueError as err:
        p.error(str(err))
    if args.cpu:
        cfg["cpu"] = True
    if args.checkpoint:
        cfg["checkpoint"] = True
    if args.strategy is not None:
        cfg["strategy"] = args.strategy
    if args.world is not None:
        cfg["world"] = args.world
    if args.out is not None:
        cfg["out"] = args.out
    if cfg["strategy"] not in STRATEGIES:
        p.error(f"strategy: expected one of {STRATEGIES}, got {cfg['strategy']!r}")
    for key in ("hidden_size", "num_heads", "head_dim", "repeats"):
        if int(cfg[key]) < 1:
            p.error(f"{key}: expected a positive integer, got {cfg[key]}")
    if int(cfg["warmup"]) < 0:
        p.error(f"warmup: expected 0 or more, got {cfg['warmup']}")
    if not cfg["lengths"]:
        p.error("lengths: expected at least one length")
    return args, cfg


def check_lengths(cfg, world: int) -> Optional[str]:
    bad = [t for t in cfg["lengths"] if t < world or t % world]
    if bad:
        return f"lengths {bad} do not split into {world} equal shards"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    _, cfg = parse(argv)
    launch = launch_env.detect(use_mpi4py=False)
    launched = launch.source != "single"
    world = launch.world_size if launched else int(cfg["world"])
    problem = check_lengths(cfg, world)
    if problem:
        print(f"{BENCHMARK}: {problem}", file=sys.stderr)
        return 2
    if launched or world <= 1:  # a failed length is a result; only a failed setup is an error
        return 1 if worker(cfg).data["setup_error"] else 0
    if not cfg["cpu"]:
        print(f"{BENCHMARK}: --world spawns local processes; use torchrun/srun for GPUs (or "
              "pass --cpu)", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from forge_dist.selftest import free_port

    try:
        mp.start_processes(_spawned, args=(world, free_port(), cfg), nprocs=world, join=True,
                           start_method="spawn")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
        print(f"{BENCHMARK}: {describe_error(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

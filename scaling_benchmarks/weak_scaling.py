"""Weak scaling: fixed tokens per GPU, every strategy x every op, forward and forward+backward.

Launch one process per GPU (NCCL)::

    torchrun --nproc_per_node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml
    srun ... python scaling_benchmarks/weak_scaling.py ...          (see slurm/weak_scaling.sbatch)

or on the CPU with gloo at tiny shapes (spawns ``--world`` processes itself)::

    python scaling_benchmarks/weak_scaling.py --cpu --world 2 [--set repeats=3]

Defaults follow docs/design.md section 10 (B=4, H=32, K=V=128, 32K tokens per GPU, bf16 inputs,
fp32 gates); ``--cpu`` starts from B=1, H=2, K=V=16, 256 tokens per rank, fp32.  Every
setting is a config key (``--config FILE``, ``--set key=value``).

One op per invocation (a sweep in pieces)
-----------------------------------------
``--ops``, ``--strategies`` and ``--modes`` (alias ``--passes``) take comma-separated names
and set the config keys ``ops``, ``strategies`` and ``passes`` (``fwd``, ``fwdbwd``), so one
invocation can measure one op (e.g. within a 10-minute device call)::

    torchrun --nproc-per-node 2 scaling_benchmarks/weak_scaling.py \
        --config configs/weak_scaling.toml --set B=1 --set tokens_per_gpu=16384 \
        --ops simple_gla --modes fwd --strategies forge,serial,lasp2,pipelined --tag b1-16k
    torchrun ... (the same) --ops gla --tag b1-16k          # adds gla's rows to the same file

Every finished configuration (row or skip) is written before the next starts, and the file is
replaced atomically, so a run killed by a time limit leaves every finished row on disk.  If the
results file (below) already exists, the run adds to it instead of starting afresh: earlier
rows stay, a configuration measured again replaces its row (a new skip entry never deletes a
measured row), ``config.ops/strategies/passes`` become the union over the runs, and op rows
get their ``vs_ideal`` from an ideal row of an earlier run when this one has none.  A file
of another shape (``B, H, K, V, D_hgrn, tokens_per_gpu, dtype``, backend), device or world
size is not merged into: the run stops with the reason (use another ``--tag``).
``--results FILE`` names the file outright (the same file on every invocation, whatever the
date); without it the name is derived from the device, date, ``--tag`` and world size.

Provenance: the header holds the device, torch and Triton versions, the commit
(``FORGE_DIST_COMMIT`` if set, else ``git rev-parse HEAD``; ``unknown`` without git, with
a warning) and the date of the latest invocation; ``runs`` has one record per invocation
(device, versions incl. CUDA, NCCL, Python and FLA, commit, host, start time, what it was
asked to measure, ``complete`` once it finished) and every row and skip entry names its
invocation by index (``"run"``).

What each number means (all per rank, then reduced over ranks as below)
------------------------------------------------------------------------
Times are CUDA events on the current stream (``time.perf_counter`` on the CPU), after
``warmup`` untimed calls, ``repeats`` timed calls, each preceded by a barrier so all ranks
start together.  Phase times come from the library's named phase edges
(:mod:`forge_dist.sp.phases`; nothing listens outside a measurement, and then an edge costs
a global read): the benchmark listens while it measures and marks the clock at each edge:
``check`` (``forge_dist.ops.checks.across_ranks``, the argument check all ranks run first),
``state_pass`` (the runner's phase 2 around ``sp.state_pass``; a sequence-parallel plan's
forward chain where runtime/plan.py marks it), ``merge`` (the runner's phase 3) and
``backward_chain`` (the reverse chain inside autograd).  A call that passes no edge (the
single-GPU plans of forward calls on CUDA) gets no breakdown.

* ``ms`` -- end-to-end time of one ``ops.<op>(..., group=WORLD, strategy=...)`` call
  (``fwdbwd``: the call plus ``o.backward(grad)``), taken per repeat as the maximum over
  ranks (a training step waits for its slowest rank), then the median over repeats;
  ``ms_min`` is the minimum over repeats of the same per-repeat maximum.  A row of
  ``strategy == "auto"`` names in ``chosen`` the strategy auto ran for that op.
* ``breakdown`` -- of the critical rank (largest median ``ms``), taken from that rank's
  median repeat so that ``local_ms + comm_ms + merge_ms`` equals its time; ``per_rank`` has
  every rank's median repeat.
  ``local_ms``: phase 1, from the call's start to the entry of the state pass (argument
  checks incl. the cross-rank check collective, the local chunk summary and, on non-last
  ranks, the shard transition ``M``); for ``fwdbwd`` it also holds the whole backward except
  the reverse chain, i.e. ``local_ms = ms - comm_ms - merge_ms``.
  ``comm_ms``: the state pass, entry to exit: waiting for the predecessor (which includes
  its local-compute skew), transfers and combines; ``fwdbwd`` adds the reverse chain.
  ``merge_ms``: phase 3 of the forward, state-pass exit (world of one: the ``merge``
  edge) to the op's return (readout of the incoming state, final state, output cast).
  ``check_ms`` (extra): the cross-rank argument check inside ``local_ms``.
* ``path`` -- ``"plan"`` where the measured calls ran on plans (the ops' short path),
  ``"general"`` where they took the runner (a dtype or shape the plans refuse);
* ``peak_mib`` -- ``torch.cuda.max_memory_allocated`` over the measurement (reset before
  warmup), MiB, maximum over ranks (``None`` on the CPU).
* ``ideal_ms`` / rows with ``measure == "ideal"`` -- the same op on the same rank's shard in a
  world of one (``group=None``), measured in the same run on every rank (concurrently, one
  GPU each): the ideal weak-scaling line.  ``vs_ideal = ms / ideal_ms``.
* rows with ``measure == "state_pass"`` -- ``forge_dist.sp.state_pass`` alone with synthetic
  summaries of the op's transition kind and state shape (fp32; the last rank passes no M, as
  the runner does): the chain latency without local-compute skew.  ``us`` = ``ms * 1000``.
* ``impl == "fla"`` rows (gated_delta_rule only): FLA 0.6.0's context parallelism
  (``fla.ops.cp``) with ``strategy == "fla_cp"``, and FLA's single-GPU kernel on the shard as
  its ideal.  FLA CP takes one packed sequence: the B rows of the shard are packed into
  ``[1, B * T_local]`` with global ``cu_seqlens`` (exactly our layout when B = 1).  Guarded:
  missing package, CPU, or refusals (e.g. gated backward on Hopper with Triton < 3.7.1) are
  recorded in ``skipped`` with the reason.  No breakdown (FLA is not instrumented).

Configurations that fail (unregistered strategy such as ``forge`` without NVSHMEM, out of
memory in the single-GPU pre-check, any exception) are listed under ``skipped`` with the
reason; every rank agrees on skips before a distributed call so none is left waiting.  The
results file is rewritten after every configuration, so a killed run keeps what it measured.

Output: ``<out>/weak_scaling_<device>_<date>[_<tag>]_ws<P>.json`` or ``--results FILE``
(docs/design.md section 10 schema plus ``runs``; the ``_ws<P>`` suffix keeps the runs of a
node-count sweep apart) and a PNG beside it (drawn from every row in the file).  ``--plot
FILE...`` redraws one figure from several runs or merged files (time vs world size per
strategy, one panel per op and pass, the ideal line dashed).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_dist import config as cfg_mod  # noqa: E402
from forge_dist import launch_env  # noqa: E402
from scaling_benchmarks import registry, results_io  # noqa: E402

OPS = registry.NAMES
STRATEGIES = ("serial", "pipelined", "lasp2", "forge")
PASSES = ("fwd", "fwdbwd")

DEFAULTS: Dict[str, Any] = {
    "B": registry.WEAK_SCALING.B, "H": registry.WEAK_SCALING.H,
    "K": registry.WEAK_SCALING.K, "V": registry.WEAK_SCALING.V,
    "D_hgrn": registry.WEAK_SCALING.D,  # HGRN width; 0 means H * K (4096 at the defaults)
    "tokens_per_gpu": registry.WEAK_SCALING_TOKENS_PER_GPU,
    "dtype": "bfloat16",        # q, k, v, x; gates are fp32 log decays
    "ops": list(OPS),
    "strategies": list(STRATEGIES),
    "passes": list(PASSES),
    # short calls (0.5 ms at 16K tokens) spread by up to 30 % between rows of one run with
    # 2 + 5 (docs/performance.md, "The log-depth passes on GPUs"): more of both
    "warmup": 3,
    "repeats": 15,
    "ideal": True,              # time the single-GPU shard (the ideal line)
    "state_pass": True,         # time sp.state_pass alone per op kind
    "fla_cp": True,             # FLA 0.6.0 context parallelism for gated_delta_rule
    "cpu": False,               # gloo on the CPU
    "world": 1,                 # processes to spawn when not under a launcher (CPU runs)
    "timeout_s": 300,           # process-group (NCCL watchdog) timeout
    "pass_timeout_s": 60,       # FORGE_DIST_TIMEOUT: bound on every state-pass wait
    "seed": 0,
    "out": "",                  # results folder; "" = scaling_benchmarks/results
    "tag": "",                  # results file name suffix (runs with one tag share a file)
    "results": "",              # the results file itself (overrides out/tag naming)
    "plot": True,
}

CPU_DEFAULTS: Dict[str, Any] = {"B": 1, "H": 2, "K": 16, "V": 16, "tokens_per_gpu": 256,
                                "dtype": "float32", "warmup": 2, "repeats": 3, "cpu": True,
                                "timeout_s": 60, "pass_timeout_s": 30}


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

class Clock:
    """Named timestamps: CUDA events on the current stream, or ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: Dict[str, Any] = {}

    def reset(self) -> None:
        self.marks = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def has(self, *names: str) -> bool:
        return all(n in self.marks for n in names)

    def ms(self, a: str, b: str) -> float:
        if self.cuda:
            return float(self.marks[a].elapsed_time(self.marks[b]))
        return (self.marks[b] - self.marks[a]) * 1e3

    def breakdown(self) -> Dict[str, float]:
        """Split the last call into the phases of the module docstring."""
        total = self.ms("start", "end")
        out = {"ms": total}
        fwd_end = "fwd_end" if self.has("fwd_end") else "end"
        if self.has("pass_start", "pass_end"):
            comm = self.ms("pass_start", "pass_end")
            merge = self.ms("pass_end", fwd_end)
        elif self.has("merge_start"):  # a world of one: the runner skips the state pass
            comm = 0.0
            merge = self.ms("merge_start", fwd_end)
        else:
            return out
        if self.has("bwd_start", "bwd_end"):
            comm += self.ms("bwd_start", "bwd_end")
        out.update(local_ms=total - comm - merge, comm_ms=comm, merge_ms=merge,
                   check_ms=self.ms("check_start", "check_end")
                   if self.has("check_start", "check_end") else 0.0)
        return out


# The library's named phase edges (forge_dist.sp.phases) -> the clock's marks.
PHASE_MARKS = {("check", True): "check_start", ("check", False): "check_end",
               ("state_pass", True): "pass_start", ("state_pass", False): "pass_end",
               ("merge", True): "merge_start",
               ("backward_chain", True): "bwd_start", ("backward_chain", False): "bwd_end"}


@contextlib.contextmanager
def phase_marks(clock: Clock):
    """Listen to the library's phase edges (:mod:`forge_dist.sp.phases`) and mark the clock
    at each (the first of each name per timed call; one op call passes each edge once)."""
    from forge_dist.sp import phases

    def hook(name: str, begin: bool) -> None:
        mark = PHASE_MARKS.get((name, begin))
        if mark is not None and mark not in clock.marks:
            clock.mark(mark)
    with phases.listen(hook):
        yield clock


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group, device: torch.device) -> None:
    if group is None:
        return
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    _sync(device)


def timed(run: Callable[[Clock], None], clock: Clock, *, warmup: int, repeats: int, group,
          device: torch.device) -> Dict[str, Any]:
    """Run ``run(clock)`` ``warmup + repeats`` times; per-repeat breakdowns and peak memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    samples = []
    for i in range(warmup + repeats):
        _barrier(group, device)
        clock.reset()
        clock.mark("start")
        run(clock)
        clock.mark("end")
        _sync(device)
        if i >= warmup:
            samples.append(clock.breakdown())
    peak = (torch.cuda.max_memory_allocated(device) / 2 ** 20) if device.type == "cuda" else None
    return {"samples": samples, "peak_mib": peak}


# ------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype name such as bfloat16, got {name!r}")
    return dt


def hgrn_width(cfg) -> int:
    return int(cfg["D_hgrn"]) or int(cfg["H"]) * int(cfg["K"])


def make_inputs(op: str, cfg, T: int, device, seed: int, requires_grad: bool):
    """One shard's inputs: activations in ``cfg.dtype``, gates fp32 log decays, drawn from a
    CPU generator seeded with ``seed`` (:func:`registry.make_inputs`)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = registry.Shape(*(int(cfg[k]) for k in ("B", "H", "K", "V")), D=hgrn_width(cfg))
    inp = registry.make_inputs(
        op, shape, T, dtype=_dtype(cfg["dtype"]),
        randn=lambda *s: torch.randn(*s, generator=gen).to(device),
        rand=lambda *s: torch.rand(*s, generator=gen).to(device))
    if requires_grad:
        for t in inp.values():
            t.requires_grad_(True)
    return inp


def _forget_signatures() -> None:
    from forge_dist.ops import planned

    planned.forget_signatures()


def _path_timed() -> str:
    """Which path the row just measured ran (after :func:`_forget_signatures`): ``"plan"``
    where its calls ran on a plan (the ops' short path, with or without a group), else
    ``"general"`` (the runner): a dtype or shape the plans refuse must not pass for a
    planned number."""
    from forge_dist.ops import planned

    return "plan" if planned.signatures_on_plans() else "general"


def call_op(op: str, inp, *, group, strategy: str):
    from forge_dist import ops

    return getattr(ops, op)(*registry.call_args(op, inp), group=group, strategy=strategy)[0]


def _runner(forward: Callable[[], torch.Tensor], inp, pass_: str):
    """A ``run(clock)`` doing the forward (and backward with a fixed upstream gradient)."""
    grad_cache: Dict[str, torch.Tensor] = {}

    def run(clock: Clock):
        for t in inp.values():
            t.grad = None
        o = forward()
        if pass_ == "fwdbwd":
            clock.mark("fwd_end")
            if "g" not in grad_cache:
                grad_cache["g"] = torch.randn_like(o)
            o.backward(grad_cache["g"])
    return run


def op_kind(op: str):
    """The op's transition kind (the variant registry's)."""
    from forge_dist.variants import registry as variants

    return variants.get(op).kind


def state_dims(op: str, cfg):
    """``(B, H, K, V)`` of the internal fp32 state (HGRN: ``[B, 1, D, 1]``)."""
    if registry.spec(op).vector_state:
        return int(cfg["B"]), 1, hgrn_width(cfg), 1
    return tuple(int(cfg[k]) for k in ("B", "H", "K", "V"))


def state_bytes(op: str, cfg) -> Dict[str, float]:
    """fp32 bytes of the state and of the shard transition M (the model uses these too)."""
    from forge_dist.variants.transitions import Kind

    B, H, K, V = state_dims(op, cfg)
    kind = op_kind(op)
    m = {Kind.IDENTITY: 0, Kind.SCALAR: B * H, Kind.DIAGONAL: B * H * K,
         Kind.DENSE: B * H * K * K}[kind] * 4
    return {"state": B * H * K * V * 4, "transition": m}


def synthetic_summary(op: str, cfg, device, rank: int, size: int, requires_grad: bool):
    """``(kind, M, delta, S0)`` shaped like the runner's, for timing the state pass alone."""
    from forge_dist.variants.transitions import Kind

    B, H, K, V = state_dims(op, cfg)
    kind = op_kind(op)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    delta = torch.randn(B, H, K, V, generator=gen).to(device)
    M = None
    if rank < size - 1 and kind is not Kind.IDENTITY:
        if kind is Kind.SCALAR:
            M = torch.full((B, H), 0.9)
        elif kind is Kind.DIAGONAL:
            M = 0.5 + 0.5 * torch.rand(B, H, K, generator=gen)
        else:
            M = 0.9 * torch.eye(K).expand(B, H, K, K) + \
                0.01 * torch.randn(B, H, K, K, generator=gen)
        M = M.to(device).contiguous()
    S0 = torch.zeros(B, H, K, V, device=device)
    if requires_grad:
        delta.requires_grad_(True)
        if M is not None:
            M.requires_grad_(True)
    return kind, M, delta, S0


# ------------------------------------------------------------------------------------------
# FLA context parallelism (external baseline, gated_delta_rule only)
# ------------------------------------------------------------------------------------------

def fla_cp_runner(inp, cfg, group, pass_: str, use_cp: bool):
    """A ``run(clock)`` for FLA's GDN: with ``use_cp`` its CP over ``group``, else one GPU."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T = inp["q"].shape[:2]
    dev = inp["q"].device
    if use_cp:
        from fla.ops.cp import build_cp_context

        size = dist.get_world_size(group)
        # One packed stream of the B rows: global offsets of B sequences of T * size tokens.
        cu = torch.arange(B + 1, dtype=torch.int32) * (T * size)
        ctx = build_cp_context(cu.to(dev), group=group, cu_seqlens_cpu=cu)
        flat = {k: v.detach().reshape(1, B * T, *v.shape[2:]).contiguous()
                for k, v in inp.items()}
        if pass_ == "fwdbwd":
            for t in flat.values():
                t.requires_grad_(True)

        def forward():
            return chunk_gated_delta_rule(flat["q"], flat["k"], flat["v"], g=flat["g"],
                                          beta=flat["beta"], cp_context=ctx)[0]
        return _runner(forward, flat, pass_)

    def forward():
        return chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=inp["g"],
                                      beta=inp["beta"])[0]
    return _runner(forward, inp, pass_)


# ------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------

def load_forge() -> Optional[str]:
    """Import the forge strategy if it is present; ``None`` or why it is not registered."""
    try:
        import forge_dist.sp.forge  # noqa: F401  (registers "forge")
    except Exception as err:  # noqa: BLE001 - a colleague's module may be mid-edit
        return f"forge_dist.sp.forge did not import ({type(err).__name__}: {err})"
    return None


def _agree(ok: bool, group, device) -> bool:
    """True on every rank only if ``ok`` on every rank (so no rank enters a lonely collective)."""
    if group is None:
        return ok
    t = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _gather(obj, group) -> List[Any]:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:400] if text else type(err).__name__


def reduce_ranks(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-repeat max over ranks -> median / min; breakdown of the critical rank."""
    n = min(len(r["samples"]) for r in per_rank)
    step = [max(r["samples"][i]["ms"] for r in per_rank) for i in range(n)]
    ranks = []
    for rank, r in enumerate(per_rank):
        # The components of one repeat (the one with the median total), so they add up.
        mid = sorted(r["samples"], key=lambda s: s["ms"])[(len(r["samples"]) - 1) // 2]
        entry = {"rank": rank, "ms": mid["ms"], "peak_mib": r["peak_mib"]}
        entry.update({k: v for k, v in mid.items() if k != "ms"})
        ranks.append(entry)
    critical = max(ranks, key=lambda e: e["ms"])
    breakdown = None
    if "local_ms" in critical:
        breakdown = {k: critical[k] for k in ("local_ms", "comm_ms", "merge_ms", "check_ms")}
        breakdown["rank"] = critical["rank"]
    peaks = [e["peak_mib"] for e in ranks if e["peak_mib"] is not None]
    return {"ms": statistics.median(step), "ms_min": min(step), "breakdown": breakdown,
            "peak_mib": max(peaks) if peaks else None, "per_rank": ranks}


# Config keys a results file's runs must share to be merged into it (besides device and
# world size): the workload's shape.  Switches (ideal, state_pass, repeats...) may differ.
MERGE_KEYS = ("B", "H", "K", "V", "D_hgrn", "tokens_per_gpu", "dtype", "backend")


def row_key(r: Dict[str, Any]) -> tuple:
    """What a row measured: a later row with the same key replaces it in a merged file."""
    return r.get("op"), r.get("pass"), r.get("impl"), r.get("strategy"), r.get("measure")


def skip_key(s: Dict[str, Any]) -> tuple:
    return s.get("op"), s.get("pass"), s.get("measure"), s.get("strategy")


def _union(a: List[Any], b: List[Any]) -> List[Any]:
    return list(a) + [x for x in b if x not in a]


def results_file(cfg, result: Dict[str, Any], size: int, out_dir: Path) -> Path:
    """``--results FILE``, else ``<out>/weak_scaling_<device>_<date>[_<tag>]_ws<P>.json``."""
    if cfg["results"]:
        return Path(cfg["results"])
    base = results_io.results_path(result, out_dir)
    return base.with_name(f"{base.stem}_ws{size}{base.suffix}")


def _versions() -> Dict[str, Any]:
    import platform

    out: Dict[str, Any] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) \
            if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a build without NCCL
        out["nccl"] = None
    try:
        from importlib.metadata import version

        out["fla"] = version("flash-linear-attention")
    except Exception:  # noqa: BLE001
        out["fla"] = None
    return out


def run_record(header: Dict[str, Any], cfg) -> Dict[str, Any]:
    """Provenance of one invocation (a merged file has one per invocation; rows and skips
    name theirs by index in ``"run"``)."""
    import datetime
    import socket

    rec = {k: header[k] for k in ("device", "torch", "triton", "commit", "date")}
    rec["switches"] = results_io.switches()  # each merged run's own
    rec.update(_versions())
    rec.update(host=socket.gethostname(),
               started=datetime.datetime.now().isoformat(timespec="seconds"),
               ops=list(cfg["ops"]), strategies=list(cfg["strategies"]),
               passes=list(cfg["passes"]),
               **{k: cfg[k] for k in ("warmup", "repeats", "ideal", "state_pass", "fla_cp",
                                      "seed")},
               complete=False)
    return rec


def legacy_run_record(result: Dict[str, Any]) -> Dict[str, Any]:
    """The run record of a file written before runs were recorded (its header's fields)."""
    rec = {k: result.get(k) for k in ("device", "torch", "triton", "commit", "date")}
    c = result.get("config", {})
    rec.update({k: c.get(k) for k in ("ops", "strategies", "passes", "warmup", "repeats")})
    return rec


class Bench:
    """One rank's view of the sweep; rank 0 assembles and writes the results."""

    def __init__(self, cfg, group, device, rank: int, size: int):
        self.cfg, self.group, self.device, self.rank, self.size = cfg, group, device, rank, size
        self.clock = Clock(device)
        self.result = results_io.header("weak_scaling", self._public_config(), size)
        if cfg["tag"]:
            self.result["tag"] = cfg["tag"]
        self.result["skipped"] = []
        self.out_dir = Path(cfg["out"]) if cfg["out"] else results_io.RESULTS_DIR
        self.path: Path = results_file(cfg, self.result, size, self.out_dir)
        self.run_index = 0  # this invocation's entry in result["runs"]
        self.result["runs"] = [run_record(self.result, cfg)]
        self.last_reason: Optional[str] = None  # why the last measure() failed (all ranks)
        self.broken: Dict[str, str] = {}  # strategy -> the timeout that retired it

    def _public_config(self):
        c = {k: v for k, v in self.cfg.items() if k not in ("out", "world", "plot", "results")}
        c["D_hgrn"] = hgrn_width(self.cfg)
        c["backend"] = "nccl" if self.device.type == "cuda" else "gloo"
        return c

    # -- bookkeeping ----------------------------------------------------------------------
    def merge_existing(self) -> Optional[str]:
        """Rank 0: continue the results file if one is at ``self.path`` (rows of other ops,
        strategies or passes from earlier invocations stay; a row measured again replaces
        its old one).  ``None``, or why this run cannot go into that file."""
        if self.rank != 0 or not self.path.exists():
            return None
        try:
            prior = results_io.load(self.path)
        except Exception as err:  # noqa: BLE001
            return f"{self.path}: exists but cannot be read to merge into ({_short(err)})"
        mine, theirs = self.result, prior
        diff = [f"{k} {theirs.get(k)!r} != {mine[k]!r}" for k in ("benchmark", "world_size",
                                                                   "device")
                if theirs.get(k) != mine[k]]
        diff += [f"{k} {theirs['config'].get(k)!r} != {mine['config'][k]!r}" for k in MERGE_KEYS
                 if theirs["config"].get(k) != mine["config"][k]]
        if diff:
            return (f"{self.path} holds another configuration ({'; '.join(diff)}): "
                    "pass another --tag or --results FILE, or move the file away")
        runs = theirs.get("runs") or [legacy_run_record(theirs)]
        self.run_index = len(runs)
        mine["runs"] = runs + mine["runs"]
        for key in ("ops", "strategies", "passes"):  # what the file covers, over all runs
            mine["config"][key] = _union(theirs["config"].get(key, []), mine["config"][key])
        mine["rows"] = list(theirs.get("rows", []))
        mine["skipped"] = list(theirs.get("skipped", []))
        if theirs.get("strategies_available"):
            mine["strategies_available"] = dict(theirs["strategies_available"])
        return None

    def add_row(self, row: Dict[str, Any], what: Dict[str, Any]) -> None:
        """Rank 0: ``row`` replaces any earlier row of the same configuration (and clears its
        skip entries); written to disk at once by :meth:`save`."""
        if self.rank != 0:
            return
        row["run"] = self.run_index
        key = row_key(row)
        self.result["rows"] = [r for r in self.result["rows"] if row_key(r) != key] + [row]
        self.result["skipped"] = [s for s in self.result["skipped"]
                                  if skip_key(s) != skip_key(what)]

    def skip(self, **fields):
        """Rank 0: record why a configuration did not run (replacing an older skip of it;
        a row measured earlier stays)."""
        if self.rank == 0:
            fields["run"] = self.run_index
            key = skip_key(fields)
            self.result["skipped"] = [s for s in self.result["skipped"]
                                      if skip_key(s) != key] + [fields]

    def save(self, complete: bool = False):
        """Rank 0: rewrite the results file (atomically: a run killed mid-write leaves the
        previous version whole)."""
        if self.rank != 0:
            return
        if complete:
            self.result["runs"][self.run_index]["complete"] = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        os.replace(tmp, self.path)

    def measure(self, run_factory: Callable[[], Callable], what: Dict[str, Any],
                single: bool) -> Optional[Dict[str, Any]]:
        """Build inputs and time them on every rank; None (and a skip entry) on failure.

        ``single``: each rank works alone (the ideal); no collective inside the timed call.
        """
        cfg, err = self.cfg, None
        try:
            run = run_factory()
        except Exception as e:  # noqa: BLE001
            run, err = None, e
        if not _agree(err is None, self.group, self.device):
            reasons = _gather(None if err is None else _short(err), self.group)
            self.last_reason = next(r for r in reasons if r)
            self.skip(**what, reason=self.last_reason)
            return None
        stats, err = None, None
        try:
            with phase_marks(self.clock):
                stats = timed(run, self.clock, warmup=int(cfg["warmup"]),
                              repeats=int(cfg["repeats"]), group=self.group, device=self.device)
            self._flush_forge()
        except Exception as e:  # noqa: BLE001
            err = e
            if os.environ.get("FORGE_DIST_BENCH_TRACE"):
                traceback.print_exc()
        del run
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        ok = _agree(err is None, self.group, self.device)
        everyone = _gather(stats if ok else (None if err is None else _short(err)), self.group)
        if not ok:
            self.last_reason = next((r for r in everyone if isinstance(r, str)),
                                    "failed on another rank")
            self.skip(**what, reason=self.last_reason)
            return None
        return reduce_ranks(everyone)

    def _flush_forge(self):
        mod = sys.modules.get("forge_dist.sp.forge")
        if mod is not None and hasattr(mod, "flush"):
            mod.flush(wait=True)  # surface a lazily reported forge timeout here

    # -- the sweep ------------------------------------------------------------------------
    def plan(self, strategies_ok: Dict[str, Optional[str]]) -> List[Dict[str, Any]]:
        cfg, items = self.cfg, []
        for op in cfg["ops"]:
            for pass_ in cfg["passes"]:
                if cfg["ideal"]:
                    items.append({"kind": "ideal", "op": op, "pass": pass_})
                if self.size > 1:
                    for s in cfg["strategies"]:
                        items.append({"kind": "op", "op": op, "pass": pass_, "strategy": s})
                if op == "gated_delta_rule" and cfg["fla_cp"]:
                    items.append({"kind": "fla_ideal", "op": op, "pass": pass_})
                    if self.size > 1:
                        items.append({"kind": "fla_cp", "op": op, "pass": pass_})
        if self.size > 1 and cfg["state_pass"]:
            for op in cfg["ops"]:
                for pass_ in cfg["passes"]:
                    for s in cfg["strategies"]:
                        items.append({"kind": "state_pass", "op": op, "pass": pass_,
                                      "strategy": s})
        return items

    def run(self, strategies_ok: Dict[str, Optional[str]]):
        cfg, T = self.cfg, int(self.cfg["tokens_per_gpu"])
        items = self.plan(strategies_ok)
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=len(items), unit="cfg", file=sys.stderr,
                       desc=f"weak_scaling P={self.size}")
        # (op, pass, impl) -> ideal ms; starts from a merged file's ideal rows (rank 0 reads
        # the file; vs_ideal is only written on rank 0), so an op row measured in a later
        # invocation than its ideal still gets its ratio
        ideal: Dict[tuple, float] = {(r["op"], r["pass"], r["impl"]): r["ms"]
                                     for r in self.result["rows"] if r.get("measure") == "ideal"}
        ideal_ok: Dict[tuple, bool] = {}
        seed = int(cfg["seed"]) * 7919 + self.rank  # a different shard per rank
        for item in items:
            op, pass_, kind = item["op"], item["pass"], item["kind"]
            strategy = item.get("strategy")
            if bar is not None:
                bar.set_postfix_str(f"{op} {pass_} {strategy or kind}")
            grad = pass_ == "fwdbwd"
            what = {"op": op, "pass": pass_, "measure": kind, "strategy": strategy}
            row = None
            if kind in ("op", "state_pass") and strategies_ok.get(strategy):
                self.skip(**what, reason=strategies_ok[strategy])
            elif kind in ("op", "state_pass") and strategy in self.broken:
                self.skip(**what, reason=f"not retried after a timeout: {self.broken[strategy]}")
            elif kind == "op" and not ideal_ok.get((op, pass_), True):
                self.skip(**what, reason="the single-GPU shard already failed (see its entry)")
            elif kind == "ideal":
                def factory(op=op, pass_=pass_, grad=grad):
                    inp = make_inputs(op, cfg, T, self.device, seed, grad)
                    return _runner(lambda: call_op(op, inp, group=None, strategy="auto"),
                                   inp, pass_)
                _forget_signatures()
                res = self.measure(factory, what, single=True)
                ideal_ok[(op, pass_)] = res is not None
                if res is not None:
                    ideal[(op, pass_, "forge_dist")] = res["ms"]
                    row = self._row(op, pass_, "forge_dist", "ideal", 1, T, res, "ideal")
                    row["path"] = _path_timed()
            elif kind == "op":
                def factory(op=op, pass_=pass_, grad=grad, strategy=strategy):
                    inp = make_inputs(op, cfg, T, self.device, seed, grad)
                    return _runner(lambda: call_op(op, inp, group=self.group,
                                                   strategy=strategy), inp, pass_)
                _forget_signatures()
                res = self.measure(factory, what, single=False)
                if res is not None:
                    row = self._row(op, pass_, "forge_dist", strategy, self.size,
                                    T * self.size, res, "op")
                    row["path"] = _path_timed()
                    if strategy == "auto":  # what auto ran (the ops resolve it the same way)
                        row["chosen"] = self._auto_choice(op)
                    base = ideal.get((op, pass_, "forge_dist"))
                    if base:
                        row["ideal_ms"], row["vs_ideal"] = base, res["ms"] / base
            elif kind in ("fla_ideal", "fla_cp"):
                reason = self._fla_reason()
                if reason:
                    self.skip(**what, reason=reason)
                else:
                    use_cp = kind == "fla_cp"

                    def factory(pass_=pass_, grad=grad, use_cp=use_cp):
                        inp = make_inputs("gated_delta_rule", cfg, T, self.device, seed, grad)
                        return fla_cp_runner(inp, cfg, self.group, pass_, use_cp)
                    res = self.measure(factory, what, single=not use_cp)
                    if res is not None:
                        res["breakdown"] = None  # FLA's phases are not instrumented
                        if use_cp:
                            row = self._row(op, pass_, "fla", "fla_cp", self.size,
                                            T * self.size, res, "op")
                            base = ideal.get((op, pass_, "fla"))
                            if base:
                                row["ideal_ms"], row["vs_ideal"] = base, res["ms"] / base
                        else:
                            ideal[(op, pass_, "fla")] = res["ms"]
                            row = self._row(op, pass_, "fla", "ideal", 1, T, res, "ideal")
            elif kind == "state_pass":
                row = self._state_pass(op, pass_, strategy, what)
            if row is None and kind in ("op", "state_pass") and self.last_reason and \
                    ("Timeout" in self.last_reason or "gave up" in self.last_reason):
                # A hung peer costs pass_timeout_s per call: do not pay it for every config.
                self.broken.setdefault(strategy, self.last_reason)
            self.last_reason = None
            if row is not None:
                self.add_row(row, what)
            self.save()  # every finished configuration is on disk before the next starts
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def _state_pass(self, op, pass_, strategy, what):
        from forge_dist import sp

        grad = pass_ == "fwdbwd"

        def factory():
            kind, M, delta, S0 = synthetic_summary(op, self.cfg, self.device, self.rank,
                                                   self.size, grad)
            strat = sp.resolve(strategy, self.device, self.group, kind=kind,
                               state=state_dims(op, self.cfg))
            upstream = torch.randn_like(delta)
            tensors = {"delta": delta} if M is None else {"delta": delta, "M": M}

            def run(clock):
                for t in tensors.values():
                    t.grad = None
                out = sp.state_pass(kind, M, delta, S0, self.group, strat, needs_grad=grad)
                if grad:
                    out.backward(upstream)
            return run
        res = self.measure(factory, what, single=False)
        if res is None:
            return None
        sizes = state_bytes(op, self.cfg)
        row = self._row(op, pass_, "forge_dist", strategy, self.size,
                        int(self.cfg["tokens_per_gpu"]) * self.size, res, "state_pass")
        row.update(us=res["ms"] * 1e3, state_mib=sizes["state"] / 2 ** 20,
                   transition_mib=sizes["transition"] / 2 ** 20, kind=op_kind(op).value)
        row["breakdown"] = None  # the whole row is the communicating phase
        if strategy == "auto":
            row["chosen"] = self._auto_choice(op)
        return row

    def _auto_choice(self, op: str) -> str:
        from forge_dist import sp
        from forge_dist.variants import registry as variants

        return sp.resolve("auto", self.device, self.group, kind=variants.get(op).kind,
                          state=state_dims(op, self.cfg)).name

    def _fla_reason(self) -> Optional[str]:
        if self.device.type != "cuda":
            return "FLA context parallelism needs CUDA"
        try:
            import fla.ops.cp  # noqa: F401
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        except Exception as err:  # noqa: BLE001
            return f"fla.ops.cp unavailable ({_short(err)})"
        return None

    def _row(self, op, pass_, impl, strategy, world, T, res, measure):
        return {"op": op, "T": T, "pass": pass_, "impl": impl, "strategy": strategy,
                "world_size": world, "tokens_per_gpu": int(self.cfg["tokens_per_gpu"]),
                "measure": measure, "ms": res["ms"], "ms_min": res["ms_min"],
                "breakdown": res["breakdown"], "peak_mib": res["peak_mib"],
                "per_rank": res["per_rank"]}


def strategy_status(names: List[str], device) -> Dict[str, Optional[str]]:
    """``{name: None if usable here else the reason}``."""
    from forge_dist import sp

    forge_reason = load_forge() if "forge" in names else None
    status = {}
    for name in names:
        if name not in sp.names():
            status[name] = (forge_reason if name == "forge" and forge_reason
                            else f"strategy {name!r} is not registered ({sp.names()})")
            continue
        try:
            sp.resolve(name, device)
            status[name] = None
        except Exception as err:  # noqa: BLE001
            status[name] = _short(err)
    return status


def worker(cfg) -> Optional[Path]:
    """The per-rank entry (under torchrun/srun, or spawned for CPU runs)."""
    os.environ.setdefault("FORGE_DIST_TIMEOUT", str(cfg["pass_timeout_s"]))
    info, device = launch_env.init_device_world(cpu=cfg["cpu"], timeout_s=float(cfg["timeout_s"]))
    use_cuda = device.type == "cuda"
    group = dist.group.WORLD if info.world_size > 1 else None
    try:
        status = strategy_status(list(cfg["strategies"]), device)
        # NVSHMEM initialises inside the first symmetric allocation: do it now, on every rank.
        if use_cuda and info.world_size > 1 and status.get("forge") is None \
                and "forge" in cfg["strategies"]:
            try:
                from forge_dist.comm import nvshmem

                nvshmem.setup(dist.group.WORLD)
            except Exception as err:  # noqa: BLE001
                status["forge"] = f"NVSHMEM setup failed ({_short(err)})"
        # Every rank must skip the same strategies.
        agreed = _gather(status, group)
        status = {k: next((s[k] for s in agreed if s[k]), None) for k in status}
        bench = Bench(cfg, group, device, info.rank, info.world_size)
        # Rank 0 continues an existing results file; every rank stops if it cannot.
        refusal = next((r for r in _gather(bench.merge_existing(), group) if r), None)
        if refusal:
            if info.rank == 0:
                print(f"weak_scaling: {refusal}", file=sys.stderr)
            raise SystemExit(2)
        if info.rank == 0 and bench.result["commit"] == "unknown":
            print("weak_scaling: commit unknown (no git here): set FORGE_DIST_COMMIT",
                  file=sys.stderr)
        bench.result.setdefault("strategies_available", {}).update(
            {k: v is None for k, v in status.items()})
        bench.save()  # the run record is on disk before the first configuration
        bench.run(status)
        bench.save(complete=True)
        if info.rank == 0 and cfg["plot"]:
            try:
                plot([bench.result], bench.path.with_suffix(".png"))
            except Exception as err:  # noqa: BLE001 - the JSON is the result
                print(f"weak_scaling: plot failed: {_short(err)}", file=sys.stderr)
        if info.rank == 0:
            print(f"weak_scaling: wrote {bench.path}", file=sys.stderr)
            summarize(bench.result)
        return bench.path
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def summarize(result) -> None:
    """Print a short table of the op rows (rank 0)."""
    print(f"\n{'op':<18}{'pass':<8}{'impl/strategy':<22}{'P':>3}{'ms':>10}{'x ideal':>9}"
          f"{'local':>9}{'comm':>9}{'merge':>9}{'peak MiB':>10}")
    for r in result["rows"]:
        if r.get("measure") == "state_pass":
            continue
        b = r.get("breakdown") or {}
        f = lambda x: f"{x:9.3f}" if isinstance(x, (int, float)) else f"{'-':>9}"  # noqa: E731
        peak = r.get("peak_mib")
        print(f"{r['op']:<18}{r['pass']:<8}{r['impl'] + '/' + str(r['strategy']):<22}"
              f"{r['world_size']:>3}{r['ms']:>10.3f}{f(r.get('vs_ideal'))}"
              f"{f(b.get('local_ms'))}{f(b.get('comm_ms'))}{f(b.get('merge_ms'))}"
              f"{(f'{peak:10.0f}' if peak is not None else f'{chr(45):>10}')}")
    if result.get("skipped"):
        print(f"\nskipped {len(result['skipped'])}:")
        for s in result["skipped"]:
            print(f"  {s['op']} {s['pass']} {s['measure']} {s.get('strategy') or ''}: "
                  f"{s['reason']}")


# ------------------------------------------------------------------------------------------
# plotting
# ------------------------------------------------------------------------------------------

def plot(results: List[Dict[str, Any]], png: Path) -> Path:
    """Time vs world size per strategy, the ideal dashed; one panel per op (rows: passes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for res in results for r in res["rows"] if r.get("measure") in ("op", "ideal")]
    ops_ = [o for o in OPS if any(r["op"] == o for r in rows)]
    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    if not ops_ or not passes:
        raise ValueError("nothing to plot: no op or ideal rows")
    fig, axes = plt.subplots(len(passes), len(ops_), figsize=(3.6 * len(ops_), 3.2 * len(passes)),
                             squeeze=False)
    worlds = sorted({r["world_size"] for r in rows if r["measure"] == "op"} | {1})
    for i, pass_ in enumerate(passes):
        for j, op in enumerate(ops_):
            ax = axes[i][j]
            mine = [r for r in rows if r["op"] == op and r["pass"] == pass_]
            for impl in ("forge_dist", "fla"):
                ideals = sorted(r["ms"] for r in mine if r["measure"] == "ideal"
                                and r["impl"] == impl)
                if ideals:
                    ax.plot(worlds, [statistics.median(ideals)] * len(worlds), "k--" if
                            impl == "forge_dist" else "k:", lw=1,
                            label="ideal (1 GPU shard)" if impl == "forge_dist" else "FLA 1 GPU")
            keys = sorted({(r["impl"], r["strategy"]) for r in mine if r["measure"] == "op"})
            for impl, strat in keys:
                pts = sorted((r["world_size"], r["ms"]) for r in mine
                             if r["measure"] == "op" and r["strategy"] == strat
                             and r["impl"] == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4,
                        label=strat if impl == "forge_dist" else f"{impl} {strat}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {pass_}", fontsize=9)
            ax.set_xlabel("GPUs (ranks)")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a merged file may lack this op x pass
                ax.legend(fontsize=6)
    res0 = results[0]
    c = res0.get("config", {})
    fig.suptitle(f"weak scaling, {c.get('tokens_per_gpu')} tokens/GPU, B={c.get('B')} "
                 f"H={c.get('H')} K={c.get('K')} V={c.get('V')} {c.get('dtype')}, "
                 f"{res0.get('device')}", fontsize=10)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------

def _spawned(rank: int, world: int, port: int, cfg) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(cfg)


def parse(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(prog="weak_scaling.py", description=__doc__.split("\n")[0])
    cfg_mod.add_arguments(p)
    p.add_argument("--cpu", action="store_true",
                   help="gloo on the CPU at tiny shapes (B=1, H=2, K=V=16, 256 tokens/rank)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn when not launched by torchrun/srun/mpirun")
    p.add_argument("--out", default=None, help="results folder (config key 'out')")
    p.add_argument("--ops", default=None, metavar="OP[,OP...]",
                   help=f"only these ops (config key 'ops'; of {','.join(OPS)})")
    p.add_argument("--strategies", default=None, metavar="S[,S...]",
                   help=f"only these strategies (config key 'strategies'; "
                        f"of {','.join(STRATEGIES)})")
    p.add_argument("--modes", "--passes", dest="modes", default=None, metavar="fwd[,fwdbwd]",
                   help="only these passes (config key 'passes')")
    p.add_argument("--tag", default=None,
                   help="results file name suffix (config key 'tag'); a later run with the "
                        "same tag (same day, world size) adds its rows to the same file")
    p.add_argument("--results", default=None, metavar="JSON",
                   help="the results file to write, or to add rows to if it exists "
                        "(config key 'results'; default: <out>/weak_scaling_<device>_<date>"
                        "[_<tag>]_ws<P>.json)")
    p.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                   help="only redraw one figure from these results files (a sweep)")
    p.add_argument("--png", default=None, help="with --plot: the figure's path")
    args = p.parse_args(argv)
    defaults = dict(DEFAULTS)
    if args.cpu:
        defaults.update(CPU_DEFAULTS)
    cfg = cfg_mod.load(defaults, args.config, args.overrides)
    if args.cpu:
        cfg["cpu"] = True
    if args.world is not None:
        cfg["world"] = args.world
    for key, value in (("out", args.out), ("tag", args.tag), ("results", args.results),
                       ("ops", args.ops), ("strategies", args.strategies),
                       ("passes", args.modes)):
        if value is not None:
            cfg[key] = value
    for key in ("ops", "strategies", "passes"):
        if isinstance(cfg[key], str):
            cfg[key] = [x.strip() for x in cfg[key].split(",") if x.strip()]
        if not cfg[key]:
            p.error(f"{key}: expected at least one name")
    from forge_dist import sp

    known = {"ops": OPS, "passes": PASSES,
             "strategies": tuple(STRATEGIES) + tuple(n for n in sp.names()
                                                     if n not in STRATEGIES)}
    for key, choices in known.items():
        extra = set(cfg[key]) - set(choices)
        if extra:
            p.error(f"{key}: unknown {sorted(extra)}; choose from {', '.join(choices)}")
    for key in ("B", "H", "K", "V", "tokens_per_gpu", "repeats"):
        if int(cfg[key]) < 1:
            p.error(f"{key}: expected a positive integer, got {cfg[key]}")
    return args, cfg


def main(argv: Optional[List[str]] = None) -> int:
    args, cfg = parse(argv)
    if args.plot:
        results = [results_io.load(f) for f in args.plot]
        png = Path(args.png) if args.png else Path(args.plot[0]).with_name(
            "weak_scaling_sweep.png")
        print(plot(results, png))
        return 0
    launched = launch_env.detect(use_mpi4py=False).source != "single"
    world = int(cfg["world"])
    if launched or world <= 1:
        worker(cfg)
        return 0
    if not cfg["cpu"]:
        print("weak_scaling: --world spawns local processes; use torchrun/srun for GPUs "
              "(or pass --cpu)", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from forge_dist.selftest import free_port

    try:
        mp.start_processes(_spawned, args=(world, free_port(), cfg), nprocs=world, join=True,
                           start_method="spawn")
    except mp.ProcessExitedException as err:  # a rank's SystemExit (reason already printed)
        return err.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

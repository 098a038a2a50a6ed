"""Host split of the planned training call at head (probe; not a benchmark)."""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from scaling_benchmarks.train_overhead import make_inputs  # noqa: E402
from forge_dist import ops  # noqa: E402
from forge_dist.ops import planned  # noqa: E402
from forge_dist.runtime import jit_launch, programs  # noqa: E402
import importlib  # noqa: E402

plan_mod = importlib.import_module("forge_dist.runtime.plan")
dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
TIMES = {}
report = {}


def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter_ns() - t)
    return w


def summary(skip=5):
    out = {}
    for k, v in TIMES.items():
        v = v[skip:] if len(v) > 2 * skip else v
        out[k] = (round(statistics.median(v) / 1e3, 1), round(min(v) / 1e3, 1), len(v))
    return out


def calls(op, T, n):
    inp = make_inputs(op, T, dev)
    leaves = list(inp["leaves"].values())
    fn = getattr(ops, op)
    do = inp["do"]
    fw, bw = [], []
    for _ in range(n):
        for x in leaves:
            x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        o, _ = fn(*leaves)
        t1 = time.perf_counter_ns()
        o.backward(do)
        t2 = time.perf_counter_ns()
        fw.append(t1 - t0)
        bw.append(t2 - t1)
    torch.cuda.synchronize()
    return fw, bw, fn, leaves, do


def plain(op, T=1024, n=40):
    fw, bw, *_ = calls(op, T, n)
    return statistics.median(fw[5:]) / 1e3, statistics.median(bw[5:]) / 1e3


# 1. plain fwd / bwd host times, no instrumentation
for op in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
    f, b = plain(op)
    report[f"plain {op}"] = (round(f, 1), round(b, 1))
    print(f"plain {op:18s} fwd {f:7.1f} us  bwd {b:7.1f} us", flush=True)

# 2. floors: an autograd Function that does nothing on the same leaves
class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


inp = make_inputs("linear_attn", 1024, dev)
leaves = list(inp["leaves"].values())
do = inp["do"]
fw, bw = [], []
for _ in range(40):
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    o = Ident.apply(*leaves)
    t1 = time.perf_counter_ns()
    o.backward(do)
    t2 = time.perf_counter_ns()
    fw.append(t1 - t0)
    bw.append(t2 - t1)
report["floor ident fn"] = (statistics.median(fw[5:]) / 1e3, statistics.median(bw[5:]) / 1e3)
print("floor identity Function fwd/bwd", report["floor ident fn"], flush=True)
ts = []
for _ in range(50):
    t = time.perf_counter_ns()
    torch.empty(1, 1024, 32, 128, dtype=torch.bfloat16, device=dev)
    ts.append(time.perf_counter_ns() - t)
report["torch.empty"] = statistics.median(ts) / 1e3
ts = []
for _ in range(50):
    t = time.perf_counter_ns()
    jit_launch.usable()
    ts.append(time.perf_counter_ns() - t)
report["jit_launch.usable"] = statistics.median(ts) / 1e3
print("empty", report["torch.empty"], "usable", report["jit_launch.usable"], flush=True)

# 3. instrumented split
plan_mod.Plan.run_backward = timed("Plan.run_backward", plan_mod.Plan.run_backward)
plan_mod._Exec.__call__ = timed("_Exec.__call__", plan_mod._Exec.__call__)
plan_mod._Exec._launch = timed("_Exec._launch", plan_mod._Exec._launch)
programs.Program.run_scoped = timed("Program.run_scoped", programs.Program.run_scoped)
jit_launch.CompiledLaunch.__call__ = timed("CompiledLaunch.__call__",
                                           jit_launch.CompiledLaunch.__call__)
planned._PlannedMatrix.backward = staticmethod(
    timed("_PlannedMatrix.backward", planned._PlannedMatrix.backward))
planned._PlannedMatrix.forward = staticmethod(
    timed("_PlannedMatrix.forward", planned._PlannedMatrix.forward))
planned._PlannedHgrn.backward = staticmethod(
    timed("_PlannedHgrn.backward", planned._PlannedHgrn.backward))
planned._PlannedHgrn.forward = staticmethod(
    timed("_PlannedHgrn.forward", planned._PlannedHgrn.forward))
planned.front = timed("planned.front", planned.front)
planned._differentiable = timed("planned._differentiable", planned._differentiable)
planned._plan_ready = timed("planned._plan_ready", planned._plan_ready)
for op in ("linear_attn", "simple_gla", "gated_delta_rule", "hgrn"):
    TIMES.clear()
    fw, bw, *_ = calls(op, 1024, 40)
    TIMES["op fwd"] = fw
    TIMES["o.backward"] = bw
    s = summary()
    report[f"split {op}"] = s
    print(f"--- split {op}")
    for k, v in s.items():
        print(f"  {k:28s} median {v[0]:8.1f}  min {v[1]:8.1f}  n={v[2]}", flush=True)

# 4. cProfile of 30 training calls (instrumentation wrappers still on)
for op in ("linear_attn", "gated_delta_rule"):
    fw, bw, fn, leaves, do = calls(op, 1024, 5)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(30):
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.backward(do)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    print(f"--- cProfile {op} (tottime)\n" + s.getvalue()[-9000:], flush=True)

# 5. torch profiler, CPU side
from torch.profiler import ProfilerActivity, profile  # noqa: E402

fw, bw, fn, leaves, do = calls("linear_attn", 1024, 5)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.backward(do)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
with open(os.path.join(OUT, "train_split2.json"), "w") as f:
    json.dump(report, f, indent=1)

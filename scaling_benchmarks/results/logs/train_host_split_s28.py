import os, sys, time, statistics
import torch
sys.path.insert(0, os.getcwd())
from scaling_benchmarks.train_overhead import make_inputs
from forge_dist import ops
from forge_dist.ops import planned
import importlib; plan_mod = importlib.import_module("forge_dist.runtime.plan")
dev = torch.device("cuda")
T0 = {}
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter_ns(); r = fn(*a, **k); T0.setdefault(name, []).append(time.perf_counter_ns() - t); return r
    return w
plan_mod.Plan.run_backward = timed("Plan.run_backward", plan_mod.Plan.run_backward)
plan_mod._Exec.__call__ = timed("_Exec.__call__", plan_mod._Exec.__call__)
planned._PlannedMatrix.backward = staticmethod(timed("_PlannedMatrix.backward", planned._PlannedMatrix.backward))
planned.matrix_call = timed("matrix_call", planned.matrix_call)
import forge_dist.ops.attention as att
att.planned = planned
for op in ("linear_attn",):
    inp = make_inputs(op, 1024, dev)
    leaves = list(inp["leaves"].values()); fn = getattr(ops, op)
    for i in range(40):
        for x in leaves: x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns(); o, _ = fn(*leaves); t1 = time.perf_counter_ns()
        o.backward(inp["do"]); t2 = time.perf_counter_ns()
        T0.setdefault("op fwd", []).append(t1 - t0); T0.setdefault("o.backward", []).append(t2 - t1)
    for x in leaves: x.grad = None
    o, _ = fn(*leaves)
    # backward on this thread, no engine: the planned Function's backward directly
    node = o.grad_fn
    for i in range(20):
        t = time.perf_counter_ns(); torch.autograd.grad(o, leaves, inp["do"], retain_graph=True); T0.setdefault("autograd.grad", []).append(time.perf_counter_ns() - t)
    for k, v in T0.items():
        v = v[5:]
        print(f"{k:28s} median {statistics.median(v)/1e3:8.1f} us  min {min(v)/1e3:8.1f}", flush=True)
    # raw costs
    x = torch.empty(1, 1024, 32, 128, device=dev)
    ts = []
    for i in range(50):
        t = time.perf_counter_ns(); torch.empty(1, 16, 32, 128, 128, dtype=torch.bfloat16, device=dev); ts.append(time.perf_counter_ns() - t)
    print("torch.empty state stack", statistics.median(ts) / 1e3)
    from forge_dist.runtime import jit_launch
    ts = []
    for i in range(50):
        t = time.perf_counter_ns(); jit_launch.usable(); ts.append(time.perf_counter_ns() - t)
    print("jit_launch.usable", statistics.median(ts) / 1e3)

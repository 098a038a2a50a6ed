"""Where a training call's host time goes: ops fwd+bwd vs its pieces (one GPU)."""
import cProfile, io, json, os, pstats, sys, time
import torch
import torch.nn.functional as F
from forge_dist import ops
from forge_dist.kernels.scalar_backward import scalar_decay_backward
from forge_dist.kernels.vector_backward import vector_decay_backward
from forge_dist.kernels.delta_backward import delta_rule_backward

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
res = []

def inputs(op, B, T, H, K=128, V=128):
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = (torch.randn(B, T, H, K, device=dev) * 0.1).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ex = []
    if op == "simple_gla":
        ex = [F.logsigmoid(torch.randn(B, T, H, device=dev)).requires_grad_()]
    if op == "gla":
        ex = [F.logsigmoid(torch.randn(B, T, H, K, device=dev)).requires_grad_()]
    if op == "gated_delta_rule":
        k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16().requires_grad_()
        ex = [F.logsigmoid(torch.randn(B, T, H, device=dev)).requires_grad_(),
              torch.rand(B, T, H, device=dev).sigmoid().requires_grad_()]
    return [q, k, v] + ex

def timed(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6

def gpu_time(fn, n=10):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    tot = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0 and e.key.startswith(("_", "triton", "void", "Memset", "elementwise", "at::", "cutlass", "vectorized")) )
    tot_all = sum(e.self_device_time_total for e in prof.key_averages())
    return tot_all / n

for op in ("linear_attn", "simple_gla", "gla", "gated_delta_rule"):
    for T in (1024, 2048, 8192):
        B, H = 1, 16
        xs = inputs(op, B, T, H)
        fn = getattr(ops, op)
        do = torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)
        def train():
            o, _ = fn(*xs)
            o.backward(do)
        def fwd_grad():
            o, _ = fn(*xs)
        def fwd_nograd():
            with torch.no_grad():
                fn(*xs)
        det = [x.detach() for x in xs]
        if op in ("linear_attn", "simple_gla"):
            g = det[3] if op == "simple_gla" else None
            def bwd_direct(): scalar_decay_backward(det[0], det[1], det[2], g, None, do, None, 128 ** -0.5)
        elif op == "gla":
            def bwd_direct(): vector_decay_backward(det[0], det[1], det[2], det[3], None, do, None, 128 ** -0.5)
        else:
            def bwd_direct(): delta_rule_backward(det[0], det[1], det[2], det[3], det[4], None, do, None, 128 ** -0.5)
        row = {"op": op, "T": T, "B": B, "H": H}
        for name, f in (("train", train), ("fwd_grad", fwd_grad), ("fwd_nograd", fwd_nograd), ("bwd_direct", bwd_direct)):
            host, wall = timed(f)
            row[name + "_host_us"] = round(host, 1); row[name + "_wall_us"] = round(wall, 1)
        row["train_gpu_us"] = round(gpu_time(train), 1)
        row["bwd_direct_gpu_us"] = round(gpu_time(bwd_direct), 1)
        print(json.dumps(row), flush=True)
        res.append(row)
        if T == 2048:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(20): train()
            pr.disable(); torch.cuda.synchronize()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
            open(f"{OUT}/cprofile_{op}.txt", "w").write(s.getvalue())
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": res}, open(f"{OUT}/train_probe.json", "w"), indent=1)

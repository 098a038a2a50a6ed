"""Why a graph replay of the 8-layer linear_attn / hgrn stack is slower than eager planned
calls at 4K-8K: the kernels of each path by the profiler, and wall time per call."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from scaling_benchmarks.kernel_profile import kernel_times  # noqa: E402
from scaling_benchmarks.train_overhead import graphed_call, make_inputs, train_call  # noqa: E402

dev = torch.device("cuda")
out = {}
for op in ("linear_attn", "hgrn"):
    for T in (8192,):
        inp = make_inputs(op, T, dev)
        row = {}
        for path in ("planned", "graphed"):
            call = (graphed_call if path == "graphed" else train_call)(op, inp, 8)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20 * 1e6
            k = kernel_times(call, 5)
            row[path] = {"wall_us": wall, "gpu_us": sum(k.values()), "kernels": k}
            print(f"{op} T={T} {path}: wall {wall:.0f} us, kernels {sum(k.values()):.0f} us",
                  flush=True)
            for name, us in list(k.items())[:14]:
                print(f"    {us:9.1f}  {name[:100]}", flush=True)
        out[f"{op} {T}"] = row
with open(os.path.join(os.environ.get("OUT", "."), "graph_probe.json"), "w") as f:
    json.dump(out, f, indent=1)

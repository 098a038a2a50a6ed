"""A/B in one process: the plans' backward programs through their straight-line run
(fastpath.specialise_program) against the general _Exec call, per op at T=1K; host time of
o.backward (sync before each call) and the back-to-back wall time per training call."""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from scaling_benchmarks.train_overhead import make_inputs  # noqa: E402
from forge_dist import ops  # noqa: E402
from forge_dist.runtime import cache as plan_cache  # noqa: E402

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
report = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("FORGE_DIST_COMMIT")}
T = int(os.environ.get("AB_T", "1024"))
for op in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
    inp = make_inputs(op, T, dev)
    leaves = list(inp["leaves"].values())
    fn = getattr(ops, op)
    do = inp["do"]
    for _ in range(5):
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.backward(do)
    torch.cuda.synchronize()
    execs = [e for p in plan_cache._PLANS.values() if p.op == op
             for e in getattr(p, "_bwd_execs", {}).values()]
    assert execs and all(e._fast is not None for e in execs), op
    fast = {id(e): e._fast for e in execs}
    res = {"fast": {"bwd": [], "b2b": []}, "general": {"bwd": [], "b2b": []}}
    for rep in range(7):
        for mode in ("fast", "general"):
            for e in execs:
                e._fast = fast[id(e)] if mode == "fast" else None
                e._specialise_pending = False
            bw = []
            for _ in range(25):
                for x in leaves:
                    x.grad = None
                o, _ = fn(*leaves)
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                o.backward(do)
                bw.append(time.perf_counter_ns() - t0)
            res[mode]["bwd"].append(statistics.median(bw) / 1e3)
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(25):
                for x in leaves:
                    x.grad = None
                o, _ = fn(*leaves)
                o.backward(do)
            torch.cuda.synchronize()
            res[mode]["b2b"].append((time.perf_counter_ns() - t0) / 25 / 1e3)
    row = {m: {k: round(statistics.median(v), 1) for k, v in d.items()} for m, d in res.items()}
    row["runs"] = res
    report[op] = row
    print(f"{op:18s} T={T} backward host (sync before) fast {row['fast']['bwd']:7.1f} general "
          f"{row['general']['bwd']:7.1f} us | b2b per call fast {row['fast']['b2b']:7.1f} "
          f"general {row['general']['b2b']:7.1f} us", flush=True)
with open(os.path.join(OUT, f"ab_backward_T{T}.json"), "w") as f:
    json.dump(report, f, indent=1)

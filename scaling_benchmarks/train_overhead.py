"""Host overhead of one training call (forward + backward) of each op on one GPU.

At short sequences a training step is host-bound: through the runner's autograd (the general
path, ``FORGE_DIST_OPS_PLANS=0``) one forward + backward took 1.5-2.7 ms on an H100 against
0.09-0.82 ms of GPU time at T = 1K-2K (``results/train_overhead_*_s28-front.json``).  The
ops' planned path
(``forge_dist/ops/planned.py``) runs the forward through the call's cached plan and the
backward through the plan's backward program (``Plan.run_backward``).  For each op and T this
times both paths on the same inputs:

* ``us_host``: Python time per call, ``--calls`` calls issued back to back (gradients set to
  ``None`` before each call, as ``zero_grad`` does), before any synchronisation;
* ``us_wall``: the same calls' wall time per call up to a synchronize: what a training loop
  pays, the larger of host and GPU time;
* ``us_gpu``: the GPU time per call (``kernel_profile.kernel_times``: ``torch.profiler``, the
  sum of the device kernels);

each the median of ``--repeats`` windows.  ``grad_rel_diff`` is the largest relative
difference between the two paths' gradients (both run the same backward kernels on the same
inputs).  B=1, H=32, K=V=128 bf16 with fp32 gates (hgrn: D=4096), T in {1K, 2K, 4K, 8K}.

With ``--graphed`` rows of path ``graphed`` time the same stack captured by
``torch.cuda.make_graphed_callables`` (forward and planned backward replayed as two CUDA
graphs; ``us_gpu`` is the planned row's, the same kernels; ``grad_rel_diff`` against the
planned path).

With ``--layers N`` a call runs the op N times stacked (each layer's ``q`` / ``x`` the output
of the layer below, one backward through the stack) and rows add ``us_*_per_layer``: what a
layer costs inside a model, where autograd's engine starts once per backward (on the H100
machines an autograd function that does nothing took 69-109 us of host time per backward
call, ``results/logs/train_split_*_s29.log``).
Results: JSON + PNG through ``results_io`` under ``scaling_benchmarks/results/``.

    python scaling_benchmarks/train_overhead.py [--ops linear_attn,...] [--T 1024,...]
        [--calls 30] [--repeats 5] [--layers 1] [--graphed] [--out DIR] [--tag TAG]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import registry, results_io  # noqa: E402
from scaling_benchmarks.kernel_profile import kernel_times  # noqa: E402

B, H, K, V, D = 1, 32, 128, 128, 4096
OPS = registry.NAMES
PATHS = {"planned": "1", "general": "0"}  # FORGE_DIST_OPS_PLANS


def make_inputs(op: str, T: int, device) -> dict:
    """Leaves that need gradients, in the op's argument order, and the output gradient."""
    gen = torch.Generator(device="cpu").manual_seed(T)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    spec = registry.spec(op)
    if spec.vector_state:
        t = {"x": r(B, T, D).bfloat16(), "g": F.logsigmoid(r(B, T, D) + 2).bfloat16()}
        do = r(B, T, D).bfloat16()
    else:
        t = {"q": r(B, T, H, K).bfloat16(), "k": F.normalize(r(B, T, H, K), dim=-1).bfloat16(),
             "v": r(B, T, H, V).bfloat16()}
        if spec.gate == "head":
            t["g"] = F.logsigmoid(r(B, T, H) + 4)
        elif spec.gate == "channel":
            t["g"] = F.logsigmoid(r(B, T, H, K) + 4)
        if "beta" in spec.args:
            t["beta"] = torch.sigmoid(r(B, T, H))
        do = r(B, T, H, V).bfloat16()
    return {"leaves": {n: x.requires_grad_(True) for n, x in t.items()}, "do": do}


def _stack(op: str, layers: int):
    """``stack(first, *rest)``: the op ``layers`` times, each layer's first input (``q``,
    hgrn's ``x``) the output of the layer below, the other inputs shared; returns the top
    output."""
    from forge_dist import ops

    fn = getattr(ops, op)

    def stack(h, *rest):
        for _ in range(layers):
            h, _ = fn(h, *rest)
        return h
    return stack


def train_call(op: str, inputs: dict, layers: int = 1):
    """One forward + backward through the public op; returns the call.  With ``layers`` > 1
    the op is stacked (:func:`_stack`) and one backward runs through the stack (as in a
    model, where autograd's engine starts once per backward, not once per layer)."""
    stack = _stack(op, layers)
    leaves, do = list(inputs["leaves"].values()), inputs["do"]

    def call():
        for x in leaves:
            x.grad = None
        stack(*leaves).backward(do)
    return call


def graphed_call(op: str, inputs: dict, layers: int = 1):
    """:func:`train_call` with the stack captured by ``torch.cuda.make_graphed_callables``
    (the leaves are its static inputs): each call replays the forward graph, and the
    backward replays the backward graph."""
    leaves, do = list(inputs["leaves"].values()), inputs["do"]
    graphed = torch.cuda.make_graphed_callables(_stack(op, layers), tuple(leaves))

    def call():
        for x in leaves:
            x.grad = None
        graphed(*leaves).backward(do)
    return call


def _windows(call, calls: int, repeats: int):
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return host, wall


def _max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for n in a:
        x, y = a[n].double(), b[n].double()
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return worst


def measure(op: str, T: int, calls: int, repeats: int, device, layers: int = 1,
            graphed: bool = False) -> list:
    inputs = make_inputs(op, T, device)
    rows, grads = [], {}
    paths = list(PATHS.items()) + ([("graphed", "1")] if graphed else [])
    for path, switch in paths:
        os.environ["FORGE_DIST_OPS_PLANS"] = switch
        call = (graphed_call if path == "graphed" else train_call)(op, inputs, layers)
        for _ in range(3):  # compile, plan, warm the allocator
            call()
        host, wall = _windows(call, calls, repeats)
        if path == "graphed":  # the planned path's kernels, replayed
            gpu = rows[0]["us_gpu"]
        else:
            gpu = sum(kernel_times(call, max(3, calls // 3)).values())
        call()
        grads[path] = {n: x.grad.detach().clone() for n, x in inputs["leaves"].items()}
        rows.append({"op": op, "T": T, "pass": "fwdbwd", "impl": "forge_dist", "path": path,
                     "us_host": statistics.median(host), "us_wall": statistics.median(wall),
                     "us_gpu": gpu, "us_wall_runs": wall, "layers": layers,
                     "us_wall_per_layer": statistics.median(wall) / layers,
                     "us_host_per_layer": statistics.median(host) / layers,
                     "us_gpu_per_layer": gpu / layers,
                     "ms": statistics.median(wall) / 1000})
    os.environ.pop("FORGE_DIST_OPS_PLANS", None)
    diff = _max_rel(grads["planned"], grads["general"])
    for r in rows:
        r["grad_rel_diff"] = diff
    if graphed:  # the graph's gradients against the planned path's (the same kernels)
        rows[-1]["grad_rel_diff"] = _max_rel(grads["graphed"], grads["planned"])
    return rows


def plot(result, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops_ = list(dict.fromkeys(r["op"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(ops_), figsize=(3.6 * len(ops_), 3.4), squeeze=False)
    for ax, op in zip(axes[0], ops_):
        for path, style in (("general", "o-"), ("planned", "s-"), ("graphed", "^-")):
            rows = sorted(results_io.rows_where(result, op=op, path=path), key=lambda r: r["T"])
            if not rows:
                continue
            Ts = [r["T"] for r in rows]
            ax.plot(Ts, [r["us_wall"] / r.get("layers", 1) for r in rows], style,
                    label=f"{path}: wall")
            if path == "planned":
                ax.plot(Ts, [r["us_gpu"] / r.get("layers", 1) for r in rows], "k--",
                        label="GPU time")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("T (tokens)")
        ax.grid(alpha=0.3)
    layers = result.get("config", {}).get("layers", 1)
    axes[0][0].set_ylabel("us per forward + backward" + (" per layer" if layers > 1 else ""))
    axes[0][0].legend(fontsize=7)
    what = "one training call" if layers == 1 else f"a stack of {layers} layers"
    fig.suptitle(f"{what} through forge_dist.ops, {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--T", default="1024,2048,4096,8192")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--graphed", action="store_true", help="also time the stack captured "
                   "by torch.cuda.make_graphed_callables (rows with path 'graphed')")
    p.add_argument("--layers", type=int, default=1, help="stack the op this many times (each "
                   "layer's q or x the output below; one backward); rows add per-layer times")
    p.add_argument("--out", default=None, help="results directory")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers: expected at least 1, got {args.layers}")
    ops_ = [o for o in args.ops.split(",") if o]
    unknown = set(ops_) - set(OPS)
    if unknown:  # bad arguments first, on any machine
        p.error(f"--ops: unknown {sorted(unknown)}; known: {OPS}")
    if not torch.cuda.is_available():
        print("train_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    Ts = [int(t) for t in args.T.split(",")]
    result = results_io.header("train_overhead", {"B": B, "H": H, "K": K, "V": V, "D": D,
                                                  "dtype": "bfloat16", "gate_dtype": "float32",
                                                  "calls": args.calls,
                                                  "repeats": args.repeats,
                                                  "layers": args.layers,
                                                  "graphed": args.graphed})
    result["tag"] = args.tag
    for op in ops_:
        for T in Ts:
            rows = measure(op, T, args.calls, args.repeats, device, args.layers,
                           args.graphed)
            result["rows"] += rows
            pl, ge = rows[:2]
            n = args.layers
            gr = (f"  graphed {rows[2]['us_wall'] / n:8.1f} us (grads vs planned "
                  f"{rows[2]['grad_rel_diff']:.1e})" if args.graphed else "")
            print(f"{op:18s} T={T:5d}  general {ge['us_wall'] / n:8.1f} us (host "
                  f"{ge['us_host'] / n:7.1f})  planned {pl['us_wall'] / n:8.1f} us (host "
                  f"{pl['us_host'] / n:7.1f})  GPU {pl['us_gpu'] / n:8.1f} / "
                  f"{ge['us_gpu'] / n:8.1f}{' per layer' if n > 1 else ''}  grads "
                  f"{pl['grad_rel_diff']:.1e}{gr}", flush=True)
    path = results_io.write(result, args.out)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every layer of :mod:`forge_dist.nn` against its FLA counterpart, one GPU, FLA's own weights.

For each layer: FLA's layer (``fla.layers``) is built at the shapes FLA's configs use with
``hidden_size=1024``, its ``state_dict`` is loaded strictly into ours, and both run the same
input ``x [2, 8192, 1024]`` in bf16:

* ``fwd`` rows: the forward under ``torch.no_grad``;
* ``fwdbwd`` rows: forward + backward of ``(o * w).sum()`` for a fixed random ``w``.

With ``--graphed`` each layer also gets ``forge_dist_graphed`` rows: the same layer captured as
CUDA graphs (:func:`forge_dist.nn.graphed`), its time, host time and ``vs_eager_rel_err``
(against the eager layer; not with ``--sp``).

Our rows record ``max_rel_err`` against FLA (``max |ours - fla| / max |fla|`` over the output,
and for ``fwdbwd`` also over ``dx`` and every parameter gradient), ``speedup`` (FLA's time over
ours), and a breakdown: ``gemm_ms`` (the layer's ``nn.Linear`` calls timed alone on inputs of
the shapes they saw) and ``op_ms`` (the ``forge_dist.ops`` call alone on the inputs it saw), with
``rest_over_op = (ms - gemm_ms) / op_ms``; ``host_us``, the host time of one call with the
GPU kept busy (at these shapes the layers are host-bound on a slow host, and then ``ms`` is
about ``host_us``); with ``--kernels N`` also ``kernels_us``, the
device time per kernel name of our layer's pass (``torch.profiler``, N calls).  A pass FLA refuses (e.g. its gated backward on
Triton 3.6 / Hopper) is a row with ``skipped`` and the reason.  Times:
``triton.testing.do_bench`` medians.  Rows go to JSON as they complete
(:mod:`scaling_benchmarks.results_io`), then a PNG.

    python scaling_benchmarks/layers.py [--layers gdn,gla] [--passes fwd,fwdbwd] [--out DIR]

With ``--sp`` (under torchrun, or ``--cpu --world 2``) it times the layers sequence-parallel
against one shard instead (:mod:`scaling_benchmarks.layers_sp`):

    torchrun --nproc-per-node 2 scaling_benchmarks/layers.py --sp [--strategy forge]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

B, T, HIDDEN = 2, 8192, 1024

#: name -> (our class name, FLA class name under fla.layers, constructor kwargs shared by
#: both); shapes of FLA's configs at hidden 1024
LAYERS = {
    "gdn": ("GatedDeltaNet", "GatedDeltaNet",
            dict(hidden_size=HIDDEN, head_dim=128, num_heads=6, expand_v=2)),
    "gla": ("GatedLinearAttention", "GatedLinearAttention",
            dict(hidden_size=HIDDEN, num_heads=4, expand_k=0.5, expand_v=1.0)),
    "retnet": ("MultiScaleRetention", "MultiScaleRetention",
               dict(hidden_size=HIDDEN, num_heads=8, expand_k=1.0, expand_v=2.0)),
    # (FLA 0.6 does not export it from fla.layers: named by its module)
    "simple_gla": ("SimpleGatedLinearAttention", "simple_gla.SimpleGatedLinearAttention",
                   dict(hidden_size=HIDDEN, num_heads=4, expand_k=1.0, expand_v=1.0)),
    "hgrn": ("HGRNAttention", "HGRNAttention", dict(hidden_size=HIDDEN, expand_ratio=1)),
    "linear_attn": ("LinearAttention", "LinearAttention",
                    dict(hidden_size=HIDDEN, num_heads=8, expand_k=1.0, expand_v=1.0)),
    "mamba2": ("Mamba2", "Mamba2",
               dict(hidden_size=HIDDEN, num_heads=32, head_dim=64, state_size=128, expand=2,
                    n_groups=1, use_conv_bias=True, use_bias=False)),
    "lightning": ("LightningAttention", None, dict(hidden_size=HIDDEN, num_heads=8)),
}
#: the ``forge_dist.ops`` functions a layer may call
OP_NAMES = ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn", "mamba2_ssd")


def _out(result):
    """The output tensor of a layer call (FLA's layers return a tuple or a tensor)."""
    return result[0] if isinstance(result, tuple) else result


def build(name, device):
    """``(ours, fla or None, reason)``: FLA's layer and ours with FLA's weights, bf16."""
    from forge_dist import nn as fnn

    ours_cls, fla_cls, kw = LAYERS[name]
    torch.manual_seed(0)
    if fla_cls is None:
        ours = fnn.__dict__[ours_cls](layer_idx=1, num_layers=4, **kw)
        return ours.to(device, torch.bfloat16), None, "no FLA counterpart"
    import importlib

    module, _, cls = fla_cls.rpartition(".")
    fla_module = importlib.import_module("fla.layers" + (f".{module}" if module else ""))
    theirs = getattr(fla_module, cls)(layer_idx=1, **kw).to(device, torch.bfloat16)
    ours = fnn.__dict__[ours_cls](layer_idx=1, **kw)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours.to(device, torch.bfloat16), theirs, None


class _Recorder:
    """Records the shapes every ``nn.Linear`` of a module saw and the arguments of the
    ``forge_dist.ops`` call, during one forward."""

    def __init__(self, layer):
        self.layer, self.linears, self.op = layer, [], None

    def __enter__(self):
        import forge_dist.ops as ops_mod

        self.handles = [m.register_forward_hook(self._hook) for m in self.layer.modules()
                        if isinstance(m, torch.nn.Linear)]
        self.saved = {n: getattr(ops_mod, n) for n in OP_NAMES if hasattr(ops_mod, n)}
        for n, fn in self.saved.items():
            setattr(ops_mod, n, self._wrap(n, fn))
        return self

    def _hook(self, module, args, out):
        self.linears.append((module, tuple(args[0].shape), args[0].dtype))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            if self.op is None:
                keep = lambda t: t.detach().clone() if torch.is_tensor(t) else t  # noqa: E731
                self.op = (fn, [keep(a) for a in args], {k: keep(v) for k, v in kwargs.items()})
            return fn(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        import forge_dist.ops as ops_mod

        for h in self.handles:
            h.remove()
        for n, fn in self.saved.items():
            setattr(ops_mod, n, fn)


def _bench(fn, rep):
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=rep, quantiles=[0.5])


def _host_us(fn, calls: int = 10) -> float:
    """Host time per call, microseconds, with the GPU kept busy by a sleep kernel queued
    first (so no launch waits for the device): where it exceeds the device time of a call,
    the layer is host-bound and its ``ms`` is about this."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the queue never drains
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls


def _graphed_row(layer, name, pas, x0, w, fla_ms, rep):
    """The row of ``layer`` captured as CUDA graphs (:func:`forge_dist.nn.graphed`; for
    ``fwd`` under ``torch.no_grad``, as the eager row runs): its time, host time and
    ``vs_eager_rel_err``, the largest ``max |a - b| / max |b|`` against the eager layer over
    the output and, for ``fwdbwd``, ``dx`` and every parameter's gradient."""
    import copy

    from forge_dist import nn as fnn

    row = {"layer": name, "pass": pas, "impl": "forge_dist_graphed"}
    grad = pas == "fwdbwd"
    try:
        eager = copy.deepcopy(layer)  # (the capture's warm-up calls touch the layer's grads)
        x = x0.detach().clone().requires_grad_(grad)
        xe = x0.detach().clone().requires_grad_(grad)
        want = _run(eager, xe, w, pas)().detach()
        with torch.set_grad_enabled(grad):
            step = fnn.graphed(layer, x0.detach().clone().requires_grad_(grad))

        def run():
            if not grad:
                with torch.no_grad():
                    return step(x)
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            o = step(x)
            (o.float() * w).sum().backward()
            return o
        errs = [_max_rel(run().detach(), want)]
        if grad:
            errs += [_max_rel(a, b) for a, b in zip(_grads(layer, x), _grads(eager, xe))
                     if a is not None and b is not None]
        row["vs_eager_rel_err"] = max(errs)
        row["ms"] = _bench(run, rep)
        row["host_us"] = _host_us(run)
        if fla_ms:
            row["speedup"] = fla_ms / row["ms"]
    except Exception as e:  # noqa: BLE001 - a layer that does not capture is a row
        traceback.print_exc()
        row["skipped"] = _reason(e)
    return row


def _reason(e: Exception) -> str:
    """An exception as a one-line skip reason."""
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def _max_rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run(layer, x, w, pas, **call):
    """A callable running one pass of ``layer`` (``fwdbwd``: gradients into ``.grad``);
    ``call``: the layer's keyword arguments (``group=`` for the sequence-parallel rows)."""
    if pas == "fwd":
        def fwd():
            with torch.no_grad():
                return _out(layer(x, **call))
        return fwd

    def fwdbwd():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        o = _out(layer(x, **call))
        (o.float() * w).sum().backward()
        return o
    return fwdbwd


def _grads(layer, x):
    return [x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


def _breakdown(layer, x, pas, rep):
    """``(gemm_ms, op_ms)`` of one pass: the layer's linears and its op, each timed alone."""
    with _Recorder(layer) as rec, torch.no_grad():
        _out(layer(x))
    grad = pas == "fwdbwd"
    gemm = 0.0
    for module, shape, dtype in rec.linears:
        inp = torch.randn(shape, device=x.device, dtype=dtype, requires_grad=grad)

        def lin(module=module, inp=inp):
            if not grad:
                with torch.no_grad():
                    return module(inp)
            inp.grad = None
            out = module(inp)
            out.backward(torch.ones_like(out))
        gemm += _bench(lin, rep)
    op_ms = None
    if rec.op is not None:
        fn, args, kwargs = rec.op
        if grad:
            args = [a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                    for a in args]

        def op():
            if not grad:
                with torch.no_grad():
                    return fn(*args, **kwargs)
            o = fn(*args, **kwargs)[0]
            o.backward(torch.ones_like(o))
        op_ms = _bench(op, rep)
    for module, _, _ in rec.linears:
        module.zero_grad(set_to_none=True)
    return gemm, op_ms


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ms" in r]
    names = list(dict.fromkeys(r["layer"] for r in rows))
    impls = [i for i in ("fla", "forge_dist", "forge_dist_graphed")
             if i != "forge_dist_graphed" or any(r["impl"] == i for r in rows)]
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, pas in zip(axes[0], ("fwd", "fwdbwd")):
        for i, impl in enumerate(impls):
            ys = [next((r["ms"] for r in rows if r["layer"] == n and r["pass"] == pas
                        and r["impl"] == impl), 0.0) for n in names]
            ax.bar([j + width * i for j in range(len(names))], ys, width=width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=30, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(pas)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"layers, {result['device']}, B={B} T={T} hidden {HIDDEN} bf16 "
                 "(0: not run, see the JSON)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--rep", type=int, default=50, help="do_bench time per measurement, ms")
    ap.add_argument("--no-breakdown", action="store_true", help="skip gemm_ms / op_ms")
    ap.add_argument("--graphed", action="store_true",
                    help="also rows of our layer captured as CUDA graphs (forge_dist.nn.graphed)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile N calls of our layer: device time per kernel "
                         "(kernels_us, the 15 largest) in its row")
    ap.add_argument("--out", default=None,
                    help="results folder (default scaling_benchmarks/results)")
    ap.add_argument("--tag", default=None, help="suffix of the results file name")
    ap.add_argument("--plot", default=None, help="only redraw the PNG of this results JSON")
    sp = ap.add_argument_group("sequence parallel (--sp)")
    sp.add_argument("--sp", action="store_true",
                    help="the layers sequence-parallel against one shard (torchrun, or --cpu)")
    sp.add_argument("--strategy", default="forge", help="the layers' strategy")
    sp.add_argument("--tokens-per-gpu", type=int, default=None,
                    help=f"tokens per rank (default {T}; with --cpu 32)")
    sp.add_argument("--repeats", type=int, default=None, help="timed calls (default 20)")
    sp.add_argument("--cpu", action="store_true",
                    help="gloo processes on the CPU (fp32 unless --cpu-dtype)")
    sp.add_argument("--cpu-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="with --cpu: the layers' dtype (bfloat16 adds the fp32 comparisons)")
    sp.add_argument("--world", type=int, default=1,
                    help="with --cpu: ranks to spawn when not launched by torchrun")
    args = ap.parse_args(argv)
    if args.plot:
        data = results_io.load(args.plot)
        if data["benchmark"] == "layers_sp":
            from scaling_benchmarks import layers_sp
            layers_sp.plot(data, Path(args.plot).with_suffix(".png"))
        else:
            plot(data, Path(args.plot).with_suffix(".png"))
        return 0
    if args.sp:
        if args.graphed:
            print("layers.py: --graphed times one GPU's layers; it does not go with --sp",
                  file=sys.stderr)
            return 2
        from scaling_benchmarks import layers_sp
        return layers_sp.main(args)
    if not torch.cuda.is_available():
        print("layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    unknown = [n for n in args.layers.split(",") if n and n not in LAYERS]
    if unknown:
        print(f"--layers: unknown {unknown}; choose from {list(LAYERS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = results_io.header("layers", {"B": B, "T": T, "hidden": HIDDEN, "dtype": "bfloat16",
                                          "layers": {n: LAYERS[n][2] for n in LAYERS}})
    if args.tag:
        result["tag"] = args.tag
    out_dir = Path(args.out) if args.out else None
    path = results_io.write(result, out_dir)

    def add(row):
        result["rows"].append(row)
        results_io.write(result, out_dir)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)

    for name in [n for n in args.layers.split(",") if n]:
        try:
            ours, theirs, why = build(name, device)
        except Exception as e:  # noqa: BLE001 - recorded, the next layer runs
            add({"layer": name, "pass": "build", "impl": "both", "skipped": _reason(e)})
            continue
        gen = torch.Generator(device=device).manual_seed(1)
        x0 = torch.randn(B, T, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(B, T, HIDDEN, device=device, generator=gen)
        for pas in args.passes.split(","):
            x = x0.clone().requires_grad_(pas == "fwdbwd")
            ref = ref_grads = fla_ms = None
            if theirs is None:
                add({"layer": name, "pass": pas, "impl": "fla", "skipped": why})
            else:
                try:
                    run = _run(theirs, x, w, pas)
                    ref = run().detach()
                    ref_grads = _grads(theirs, x) if pas == "fwdbwd" else None
                    ref_grads = None if ref_grads is None else [
                        None if g is None else g.detach().clone() for g in ref_grads]
                    fla_ms = _bench(run, args.rep)
                    add({"layer": name, "pass": pas, "impl": "fla", "ms": fla_ms,
                         "host_us": _host_us(run)})
                except Exception as e:  # noqa: BLE001 - e.g. FLA's backward refused
                    add({"layer": name, "pass": pas, "impl": "fla", "skipped": _reason(e)})
                    ref = None
            try:
                run = _run(ours, x, w, pas)
                out = run().detach()
                row = {"layer": name, "pass": pas, "impl": "forge_dist"}
                if ref is not None:
                    errs = [_max_rel(out, ref)]
                    if ref_grads is not None:
                        errs += [_max_rel(a, b) for a, b in zip(_grads(ours, x), ref_grads)
                                 if a is not None and b is not None]
                    row["max_rel_err"] = max(errs)
                row["ms"] = _bench(run, args.rep)
                row["host_us"] = _host_us(run)
                if fla_ms:
                    row["speedup"] = fla_ms / row["ms"]
                if not args.no_breakdown:
                    gemm, op_ms = _breakdown(ours, x0, pas, args.rep)
                    row.update(gemm_ms=gemm, op_ms=op_ms)
                    if op_ms:
                        row["rest_over_op"] = (row["ms"] - gemm) / op_ms
                if args.kernels:  # where the time outside the GEMMs and the op goes
                    from scaling_benchmarks.kernel_profile import kernel_times
                    times = kernel_times(run, args.kernels)
                    row["kernels_us"] = dict(list(times.items())[:15])
                add(row)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                add({"layer": name, "pass": pas, "impl": "forge_dist", "skipped": _reason(e)})
            if args.graphed:
                add(_graphed_row(ours, name, pas, x0, w, fla_ms, args.rep))
            x = run = ref = ref_grads = None
            torch.cuda.empty_cache()
        ours = theirs = None
        torch.cuda.empty_cache()
    try:
        plot(result, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}", file=sys.stderr)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

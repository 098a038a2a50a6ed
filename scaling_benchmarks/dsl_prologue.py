"""Prologues of DSL variants three ways: one generated elementwise kernel per input before the
template (the default), the template's kernels mapping each tile as they load it, and PyTorch
ops before the template.

Three variants written as three callables each (what a user would write):

* ``elu_linear_attn`` (:mod:`forge_dist.dsl.library`): ``elu(x) + 1`` on q and k, linear_attn
  template;
* ``relu_logsigmoid_gla``: ``relu`` on q and k, ``logsigmoid`` turning a raw gate into the log
  decay, simple_gla template;
* ``silu_hgrn``: ``silu`` on x, ``logsigmoid`` on the gate, hgrn template.

Rows (``impl``): ``prologue_kernels`` (every chain as a generated kernel,
``forge_dist.kernels.prologue``; the default lowering does this for chains of two or more ops
and leaves single ops to PyTorch, ``dsl.lowering.PROLOGUE_KERNEL_MIN_OPS``), ``fused``
(``fuse_prologues=True``), ``pytorch_prologue`` (every chain as PyTorch ops), and
``template_premapped``: the template's op on inputs mapped beforehand, the prologue's time
left out (a floor for the forward).  Passes ``fwd`` (no
grad) and ``fwdbwd``.  Shapes of the single-device protocol: B=1, H=32, K=V=128 bf16; hgrn
x, g [1, T, 4096] bf16; raw gates fp32 for the matrix variant.

    python scaling_benchmarks/dsl_prologue.py [--T 4096,16384,65536] [--out DIR] [--tag X]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling_benchmarks import results_io  # noqa: E402

B, H, K, V, D = 1, 32, 128, 128, 4096
TR = lambda x: x.transpose(-1, -2)  # noqa: E731


def _variants(mode: str):
    """The three variants with prologues ``fused`` into the template, as generated
    ``kernels`` (the default), or as ``pytorch`` ops."""
    from forge_dist import dsl
    from forge_dist.kernels import prologue
    from forge_dist.dsl.helpers import segsum_exp, segsum_exp_vec

    def sg_chunk(k, v, g):
        G = F.logsigmoid(g).cumsum(-1)
        return TR(torch.relu(k) * (G[..., -1:] - G).exp()[..., None]) @ v

    def sg_decay(state, chunk_state, g):
        return state * F.logsigmoid(g).sum(-1).exp()[..., None, None] + chunk_state

    def sg_merge(state, q, k, v, g, scale):
        G = F.logsigmoid(g).cumsum(-1)
        qf, kf = torch.relu(q), torch.relu(k)
        return scale * (((qf @ TR(kf)) * segsum_exp(G)) @ v + (qf * G.exp()[..., None]) @ state)

    def hg_chunk(x, g):
        h = dsl.cache("h", (segsum_exp_vec(F.logsigmoid(g).cumsum(-2))
                            * F.silu(x)[..., None, :, :]).sum(-2))
        return h[..., -1, :]

    def hg_decay(state, chunk_state, g):
        return state * F.logsigmoid(g).sum(-2).exp() + chunk_state

    def hg_merge(state, h, g):
        return h + F.logsigmoid(g).cumsum(-2).exp() * state[..., None, :]

    from forge_dist.dsl import lowering

    kw = dict(fuse_prologues=mode == "fused")
    real, min_ops = prologue.kernel_prologue, lowering.PROLOGUE_KERNEL_MIN_OPS
    if mode == "pytorch":  # the lowering then keeps each chain as PyTorch ops
        prologue.kernel_prologue = lambda *a, **k: None
    if mode == "kernels":  # every chain, one op included (the default keeps those PyTorch)
        lowering.PROLOGUE_KERNEL_MIN_OPS = 1
    try:
        return _build(dsl, kw, sg_chunk, sg_decay, sg_merge, hg_chunk, hg_decay, hg_merge)
    finally:
        prologue.kernel_prologue, lowering.PROLOGUE_KERNEL_MIN_OPS = real, min_ops


def _build(dsl, kw, sg_chunk, sg_decay, sg_merge, hg_chunk, hg_decay, hg_merge):
    from forge_dist.dsl.library import _elu_chunk, _elu_decay, _elu_merge

    return {
        "elu_linear_attn": dsl.variant("elu_linear_attn", chunk_mode=_elu_chunk,
                                       decay_mode=_elu_decay, merge_mode=_elu_merge,
                                       inputs=("q", "k", "v"), **kw),
        "relu_logsigmoid_gla": dsl.variant("relu_logsigmoid_gla", chunk_mode=sg_chunk,
                                           decay_mode=sg_decay, merge_mode=sg_merge,
                                           inputs=("q", "k", "v", "g"), **kw),
        "silu_hgrn": dsl.variant("silu_hgrn", chunk_mode=hg_chunk, decay_mode=hg_decay,
                                 merge_mode=hg_merge, state="vector", inputs=("x", "g"),
                                 chunk_size=16, **kw),
    }


def _inputs(name, T, device):
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*s, dtype=torch.bfloat16):
        return torch.randn(*s, device=device, generator=gen).to(dtype)

    if name == "silu_hgrn":
        return {"x": r(B, T, D), "g": r(B, T, D) + 3}
    inp = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V)}
    if name == "relu_logsigmoid_gla":
        inp["g"] = r(B, T, H, dtype=torch.float32) + 4
    return inp


def _premapped(name, inp):
    """The template op and its inputs mapped beforehand (as the lowering's PyTorch path)."""
    from forge_dist import ops

    if name == "elu_linear_attn":
        f = lambda t: F.elu(t) + 1.0  # noqa: E731
        return ops.linear_attn, dict(q=f(inp["q"]), k=f(inp["k"]), v=inp["v"])
    if name == "relu_logsigmoid_gla":
        return ops.simple_gla, dict(q=inp["q"].relu(), k=inp["k"].relu(), v=inp["v"],
                                    g=F.logsigmoid(inp["g"]))
    return ops.hgrn, dict(x=F.silu(inp["x"]), g=F.logsigmoid(inp["g"].float()).to(inp["g"].dtype))


def _fwd(fn, inp):
    def run():
        with torch.no_grad():
            return fn(**inp)[0]
    return run


def _fwdbwd(fn, inp):
    leaves = {n: t.detach().requires_grad_() for n, t in inp.items()}

    def run():
        for t in leaves.values():
            t.grad = None
        o = fn(**leaves)[0]
        o.backward(torch.ones_like(o))
    return run


def plot(result, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({r["op"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in result["rows"] if r["op"] == name]
        for impl, pas in sorted({(r["impl"], r["pass"]) for r in rows}):
            pts = sorted((r["T"], r["ms"]) for r in rows if (r["impl"], r["pass"]) == (impl, pas))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if pas == "fwd" else "s--",
                    label=f"{impl} {pas}", ms=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("T")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"DSL prologues: generated kernels, fused, PyTorch; {result['device']}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="4096,16384,65536")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dsl_prologue: needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    Ts = [int(t) for t in args.T.split(",")]
    passes = args.passes.split(",")
    result = results_io.header("dsl_prologue", {"B": B, "H": H, "K": K, "V": V, "D_hgrn": D,
                                                "T": Ts, "passes": passes})
    if args.tag:
        result["tag"] = args.tag
    kinds = {"prologue_kernels": _variants("kernels"), "fused": _variants("fused"),
             "pytorch_prologue": _variants("pytorch")}
    for name in kinds["fused"]:
        result["config"].setdefault("prologues", {})[name] = {
            impl: vs[name].lowering.summary() for impl, vs in kinds.items()}
        for T in Ts:
            inp = _inputs(name, T, "cuda")
            op, pre = _premapped(name, inp)
            impls = {impl: (vs[name], inp) for impl, vs in kinds.items()}
            impls["template_premapped"] = (op, pre)
            for pas in passes:
                for impl, (fn, x) in impls.items():
                    run = (_fwd if pas == "fwd" else _fwdbwd)(fn, x)
                    ms = do_bench(run, warmup=25, rep=100)
                    result["rows"].append({"op": name, "T": T, "pass": pas, "impl": impl,
                                           "ms": ms})
                    print(f"{name:22s} {T:7d} {pas:7s} {impl:20s} {ms:8.3f} ms", flush=True)
            del inp, pre
            torch.cuda.empty_cache()
    path = results_io.write(result, args.out)
    plot(result, path.with_suffix(".png"))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

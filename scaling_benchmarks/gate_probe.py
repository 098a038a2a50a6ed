"""Probe behind commit a7f85c2 (results/gate_probe_NVIDIA-H200_2026-11-24.json, run at 221137e).

``split``: the scalar walker's two launches timed apart (segment summaries, output walks) and
the output walks with a precomputed in-chunk attention, for simple_gla and linear_attn.
``dsl``: the ops and the DSL forward with fp32 and bf16 scalar gates, with per-kernel times.

    python scaling_benchmarks/gate_probe.py [split] [dsl]   (writes $OUT/probe.json)
"""
import json, os, sys, torch, triton.testing
sys.path.insert(0, os.getcwd())
from forge_dist.kernels import _common as C, scalar
from scaling_benchmarks.single_device import make_inputs, ops_fn, dsl_fn
from scaling_benchmarks.kernel_profile import kernel_times
OUT = os.environ.get("OUT", "out"); dev = "cuda"; bf = torch.bfloat16
res = []
def bench(fn):
    fn(); torch.cuda.synchronize(); return triton.testing.do_bench(fn, warmup=5, rep=40)
def rec(**kw):
    print(kw, flush=True); res.append(kw)
    json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1)

def attn(q, k, g, BT=64):
    B, T, H, K = q.shape; NT = T // BT
    qc = q.view(B, NT, BT, H, K).permute(0, 3, 1, 2, 4).float()
    kc = k.view(B, NT, BT, H, K).permute(0, 3, 1, 2, 4).float()
    A = qc @ kc.transpose(-1, -2)
    del qc, kc
    if g is not None:
        G = g.view(B, NT, BT, H).permute(0, 3, 1, 2).float().cumsum(-1)
        D = G[..., :, None] - G[..., None, :]
        A = A * torch.exp(D.masked_fill(~torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(), float("-inf")))
    else:
        A = A.tril()
    return A.permute(0, 2, 3, 1, 4).reshape(B, T, H, BT).to(q.dtype).contiguous()

which = sys.argv[1:] or ["split", "dsl"]
with torch.no_grad():
  if "split" in which:
    for op in ("simple_gla", "linear_attn"):
      for T in (16384, 65536):
        inp = make_inputs(op, T, dev)
        q, k, v, g = inp["q"], inp["k"], inp["v"], inp.get("g")
        gate = 1 if g is not None else 0
        prec = C.dot_precision(bf); scale = 128 ** -0.5
        A = attn(q, k, g)
        for BV, nw, ns in ((64, 4, 2), (128, 8, 2), (64, 8, 2), (32, 4, 2), (128, 4, 2)):
          cfg = dict(BT=64, BV=BV, num_warps=nw, num_stages=ns, tune=False)
          for n_seg in (8, 16):
            S = C.summarize(k, v, g=g, gate=gate, cfg=cfg, prec=prec, n_seg=n_seg)
            ref = C.walk(k, v, q=q, g=g, gate=gate, scale=scale, out_dtype=bf, cfg=cfg, prec=prec, n_seg=n_seg)[0].float()
            oa = C.outputs_from_summary(S, k, v, q=q, g=g, gate=gate, scale=scale, out_dtype=bf, cfg=cfg, prec=prec, a=A)[0].float()
            err = ((oa - ref).norm() / ref.norm()).item()
            rec(op=op, T=T, BV=BV, nw=nw, ns=ns, n_seg=n_seg, err_A=err,
                total=bench(lambda: C.walk(k, v, q=q, g=g, gate=gate, scale=scale, out_dtype=bf, cfg=cfg, prec=prec, n_seg=n_seg)),
                summary=bench(lambda: C.summarize(k, v, g=g, gate=gate, cfg=cfg, prec=prec, n_seg=n_seg)),
                outputs=bench(lambda: C.outputs_from_summary(S, k, v, q=q, g=g, gate=gate, scale=scale, out_dtype=bf, cfg=cfg, prec=prec)),
                outputs_A=bench(lambda: C.outputs_from_summary(S, k, v, q=q, g=g, gate=gate, scale=scale, out_dtype=bf, cfg=cfg, prec=prec, a=A)))
        del A
  if "dsl" in which:
    for op in ("gated_delta_rule", "simple_gla"):
      for T in (16384, 65536):
        inp = make_inputs(op, T, dev)
        for gdt in (torch.float32, bf):
          i2 = dict(inp); i2["g"] = inp["g"].to(gdt)
          fo = ops_fn(op, i2)
          from forge_dist.dsl.builtins import BUILTINS
          var = BUILTINS[op]
          names = [n for n in ("q", "k", "v", "g", "beta") if n in i2]
          fd = (lambda var=var, a=[i2[n] for n in names]: var(*a)[0])
          rec(op=op, T=T, g=str(gdt), ops=bench(fo), dsl=bench(fd),
              ops_k=kernel_times(fo, 5), dsl_k=kernel_times(fd, 5))

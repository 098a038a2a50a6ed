import json, os, sys, torch
sys.path.insert(0, ".")
from scaling_benchmarks.kernel_profile import kernel_times
from scaling_benchmarks.single_device import make_inputs
from forge_dist.kernels import _common, scalar, scheduler
dev = torch.device("cuda"); rows = []
for op in ("simple_gla", "linear_attn"):
    for T in (4096, 16384, 65536):
        inp = make_inputs(op, T, dev)
        q, k, v, g = inp["q"], inp["k"], inp["v"], inp.get("g")
        B, _, H, K = q.shape; V = v.shape[-1]
        base = dict(scalar.fused_config(K, V), tune=False)
        n = scheduler.schedule(B, T, H, K, V, base["BT"], min(base["BV"], V)).n_seg
        ref = None
        for sbv, nw in ((64, 4), (32, 4), (16, 4), (32, 2), (16, 2), (128, 8)):
            cfg = dict(base, summary_BV=sbv)
            scfg_nw = dict(cfg, BV=sbv, num_warps=nw)
            _common.summary_config = (lambda c, s=scfg_nw: s)  # the experiment's summary tiles
            fn = lambda: _common.walk(k, v, q=q, g=g, gate=0 if g is None else 1, cfg=cfg, scale=K ** -0.5,
                                      prec=_common.dot_precision(q.dtype), n_seg=n, out_dtype=q.dtype)
            with torch.no_grad():
                o, ht = fn(); per = kernel_times(fn, 20)
            d = 0.0 if ref is None else (o.float() - ref).abs().max().item()
            ref = o.float() if ref is None else ref
            r = {"op": op, "T": T, "n_seg": n, "summary_BV": sbv, "summary_warps": nw, "gpu_us": sum(per.values()), "kernels_us": per, "max_abs_diff_vs_64": d}
            rows.append(r); print(op, T, n, sbv, nw, round(r["gpu_us"], 1), d, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "summary_bv.json"), "w"), indent=1)

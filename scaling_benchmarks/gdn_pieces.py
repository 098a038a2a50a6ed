"""gated_delta_rule on one GPU, piece by piece: where the forward and the shard summary spend
their time, and how accurate the summary (delta, M) is at each precision.

    python scaling_benchmarks/gdn_pieces.py            # writes $OUT/gdn_pieces.json (OUT=. default)

Timing shape: the weak-scaling shard (B=4, T=32K, H=32, K=V=128, bf16), CUDA events, median
of 3 after one warm-up.  Pieces: the WY kernel (fp32 and bf16 operands), the fp32 cast of k
and v, the delta walk and the M walk (fp32 operands with 3xTF32 or TF32 dots, bf16
operands), and the forward's own output walk.  Accuracy: B=1, T=8K, H=4 against the fp64
PyTorch chunk form; ``combined_rel`` is the relative error of ``M S + delta`` for a random S
(``M_rel`` is NaN when the shard's decays make M vanish).  Needs CUDA.  (The committed results came from this computation before it was wrapped in
functions.)
"""
import json
import os

import torch
from forge_dist.kernels import delta as D
from forge_dist.kernels._common import walk
from forge_dist.variants import delta_rule

dev = "cuda"

def inputs(B, T, H, K, V, dtype):
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 3)
    beta = torch.rand(B, T, H, device=dev)
    return q, k, v, g, beta

def timeit(fn, n=3):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

def pieces(q, k, v, g, beta, prec_walk, wy_dtype, cfg):
    B, T, H, K = k.shape
    kk = k.to(wy_dtype); vv = v.to(wy_dtype)
    wyp = "tf32" if wy_dtype != torch.float32 else "tf32x3"
    w, u = D.wy(kk, vv, g, beta, BT=cfg["BT"], prec=wyp, dtype=wy_dtype)
    _, delta = walk(kk, u, g=g, gate=1, w=w, cfg=cfg, prec=prec_walk)
    eye = torch.eye(K, dtype=torch.float32, device=dev).expand(B, H, K, K)
    _, M = walk(kk, None, V=K, g=g, gate=1, w=w, h0=eye, cfg=cfg, prec=prec_walk)
    return w, u, delta, M

def timing(cfg):
    """Milliseconds of each piece at the weak-scaling shard."""
    q, k, v, g, beta = inputs(4, 32768, 32, 128, 128, torch.bfloat16)
    k32, v32 = k.float(), v.float()
    B, T, H, K = k.shape
    eye = torch.eye(K, dtype=torch.float32, device=dev).expand(B, H, K, K)
    w32, u32 = D.wy(k32, v32, g, beta, BT=64, prec="tf32x3", dtype=torch.float32)
    w16, u16 = D.wy(k, v, g, beta, BT=64, prec="tf32", dtype=torch.bfloat16)
    t = {}
    t["wy_fp32"] = timeit(lambda: D.wy(k32, v32, g, beta, BT=64, prec="tf32x3", dtype=torch.float32))
    t["wy_bf16"] = timeit(lambda: D.wy(k, v, g, beta, BT=64, prec="tf32", dtype=torch.bfloat16))
    t["cast_kv_fp32"] = timeit(lambda: (k.float(), v.float()))
    for p in ("tf32x3", "tf32"):
        t[f"delta_walk_fp32_{p}"] = timeit(lambda: walk(k32, u32, g=g, gate=1, w=w32, cfg=cfg, prec=p))
        t[f"M_walk_fp32_{p}"] = timeit(lambda: walk(k32, None, V=K, g=g, gate=1, w=w32, h0=eye, cfg=cfg, prec=p))
    t["delta_walk_bf16"] = timeit(lambda: walk(k, u16, g=g, gate=1, w=w16, cfg=cfg, prec="tf32x3"))
    t["M_walk_bf16"] = timeit(lambda: walk(k, None, V=K, g=g, gate=1, w=w16, h0=eye, cfg=cfg, prec="tf32x3"))
    t["finish_walk_bf16"] = timeit(lambda: walk(k, u16, q=q, g=g, gate=1, w=w16, cfg=cfg, prec="tf32x3", out_dtype=torch.bfloat16))
    return t


def main():
    torch.manual_seed(0)
    res = {"timing_ms": {}, "accuracy": {}}
    cfg = D.fused_config(128, 128)
    res["timing_ms"] = timing(cfg)
    print(json.dumps(res["timing_ms"], indent=1), flush=True)
    torch.cuda.empty_cache()
    # accuracy vs fp64 chunk form
    q, k, v, g, beta = inputs(1, 8192, 4, 128, 128, torch.bfloat16)
    ref = delta_rule.summarize(q.double(), k.double(), v.double(), g.double(), beta.double(), 128 ** -0.5, need_transition=True)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for name, pw, wd in [("fp32_tf32x3", "tf32x3", torch.float32), ("fp32_tf32", "tf32", torch.float32), ("bf16", "tf32x3", torch.bfloat16)]:
        _, _, delta, M = pieces(q, k, v, g, beta, pw, wd, cfg)
        res["accuracy"][name] = {"delta_rel": rel(delta, ref.delta), "M_rel": rel(M, ref.transition)}
        S = torch.randn_like(delta)
        comb = torch.einsum("bhij,bhjv->bhiv", M, S) + delta
        combr = torch.einsum("bhij,bhjv->bhiv", ref.transition, S.double()) + ref.delta
        res["accuracy"][name]["combined_rel"] = rel(comb, combr)
    print(json.dumps(res["accuracy"], indent=1))
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "gdn_pieces.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

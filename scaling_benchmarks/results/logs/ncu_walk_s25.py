"""One simple_gla (or argv[2]) forward walk (the scheduler's segments) per T, for Nsight Compute."""
import sys, torch
sys.path.insert(0, ".")
from scaling_benchmarks.single_device import make_inputs
from forge_dist.kernels import _common, scalar, scheduler
dev = torch.device("cuda")
for T in [int(t) for t in sys.argv[1].split(",")]:
    op = sys.argv[2] if len(sys.argv) > 2 else "simple_gla"
    inp = make_inputs(op, T, dev)
    q, k, v, g = inp["q"], inp["k"], inp["v"], inp.get("g")
    B, _, H, K = q.shape; V = v.shape[-1]
    cfg = dict(scalar.fused_config(K, V), tune=False)
    n = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], V)).n_seg
    with torch.no_grad():
        for _ in range(2):
            _common.walk(k, v, q=q, g=g, gate=0 if g is None else 1, cfg=cfg, scale=K ** -0.5,
                         prec=_common.dot_precision(q.dtype), n_seg=n, out_dtype=q.dtype)
    torch.cuda.synchronize()

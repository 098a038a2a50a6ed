"""Time the scalar walker's source variants (GPU time per forward call, profiler)."""
import json, os, shutil, subprocess, sys
TARGET = "forge_dist/kernels/_common.py"
CHILD = r'''
import json, sys, torch
sys.path.insert(0, ".")
from scaling_benchmarks.kernel_profile import kernel_times, _bench
from scaling_benchmarks.single_device import make_inputs
from forge_dist.kernels import _common, scalar, scheduler
dev = torch.device("cuda")
out = []
for op in ("linear_attn", "simple_gla"):
    for T in (4096, 16384, 65536):
        inp = make_inputs(op, T, dev)
        q, k, v, g = inp["q"], inp["k"], inp["v"], inp.get("g")
        B, _, H, K = q.shape; V = v.shape[-1]
        cfg = dict(scalar.fused_config(K, V), tune=False)
        n = scheduler.schedule(B, T, H, K, V, cfg["BT"], min(cfg["BV"], V)).n_seg
        fn = lambda: _common.walk(k, v, q=q, g=g, gate=0 if g is None else 1, cfg=cfg, scale=K ** -0.5,
                                  prec=_common.dot_precision(q.dtype), n_seg=n, out_dtype=q.dtype)
        with torch.no_grad():
            o, ht = fn()
            per = kernel_times(fn, 20)
        out.append({"op": op, "T": T, "n_seg": n, "gpu_us": sum(per.values()), "kernels_us": per,
                    "o_checksum": o.float().abs().sum().item(), "ht_checksum": ht.abs().sum().item()})
print("RESULT " + json.dumps(out))
'''
rows = []
shutil.copy(TARGET, "/tmp/_common_saved.py")
try:
    for var in sys.argv[1].split(","):
        shutil.copy(f"scratch/variants/_common_{var}.py", TARGET)
        r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(var, "FAILED", r.stderr[-2000:], flush=True); continue
        for x in json.loads(line[0][7:]):
            x["variant"] = var; rows.append(x)
            print(var, x["op"], x["T"], x["n_seg"], round(x["gpu_us"], 1), x["o_checksum"], flush=True)
finally:
    shutil.copy("/tmp/_common_saved.py", TARGET)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "variant_bench.json"), "w"), indent=1)

"""Where a static plan call's end-to-end overhead goes, on the device (s26 probe).

Rows (us, median of N, GPU idle before each call): host time and call+sync time for
  sync_only, empty_alloc, checks (the specialised run's condition), bound, raw2, raw1 (first
  launch only), raw1_extra (first launch, params as one buffer via `extra`), raw2_side (a
  non-default stream), run (specialised), run_general, graph replay; plus GPU times.
"""
import ctypes, json, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forge_dist.runtime import aot, plan
from forge_dist.runtime.dispatcher import CtypesDriver, Dispatcher

N = int(os.environ.get("N", "300"))
dev = torch.device("cuda", 0)
cache_dir = Path.home() / ".cache" / "forge_dist" / "aot_bench"
cfg = dict(variants=["simple_gla"], heads=[32], head_dims=[[128, 128]], dtypes=["bfloat16"],
           execution=["decoupled"], initial_state=[False], sequence_parallel=False)
aot.compile_all(cfg, target="cuda:90", cache_dir=cache_dir)
cache = aot.CubinCache(cache_dir, "cuda:90")
out = {"device": torch.cuda.get_device_name(0), "rows": {}}

def host_e2e(fn, n=N):
    h, e = [], []
    for _ in range(20): fn()
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
        torch.cuda.synchronize(); t2 = time.perf_counter()
        h.append((t1 - t0) * 1e6); e.append((t2 - t0) * 1e6)
    return round(statistics.median(h), 2), round(statistics.median(e), 2)

def gpu(fn, n=N):
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return round(statistics.median(ts), 2)

for T in (1024, 4096):
    B, H, K = 1, 32, 128
    q, k, v = (torch.randn(B, T, H, K, device=dev).to(torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev) + 4)
    drv = CtypesDriver()
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=K, dtype=torch.bfloat16, device=dev,
             backend="static", dispatcher=Dispatcher(cache, drv), execution="decoupled")
    assert "run" in vars(p), "not specialised"
    o = torch.empty(B, T, H, K, dtype=torch.bfloat16, device=dev)
    bound = p.bind(q, k, v, g, out=o)
    steps = bound._steps
    st = p.finish_exec.stream()
    L = drv.lib.cuLaunchKernel
    raw = [(head, pack) for _, head, pack in steps]
    def raw2():
        for (fn, grid, bx, sh), pack in raw:
            L(fn, grid[0], grid[1], grid[2], bx, 1, 1, sh, st, pack.params_address, None)
    def raw1():
        (fn, grid, bx, sh), pack = raw[0]
        L(fn, grid[0], grid[1], grid[2], bx, 1, 1, sh, st, pack.params_address, None)
    # params as one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END)
    (fn0, grid0, bx0, sh0), pack0 = raw[0]
    size = ctypes.c_size_t(pack0.size)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(pack0.buffer), 2, ctypes.addressof(size), 0)
    extra_addr = ctypes.addressof(extra)
    def raw1_extra():
        L(fn0, grid0[0], grid0[1], grid0[2], bx0, 1, 1, sh0, st, None, extra_addr)
    side = torch.cuda.Stream(dev)
    side_h = side.cuda_stream
    def raw2_side():
        for (fn, grid, bx, sh), pack in raw:
            L(fn, grid[0], grid[1], grid[2], bx, 1, 1, sh, side_h, pack.params_address, None)
    shape = (B, T, H, K)
    def empty_alloc():
        torch.empty(shape, dtype=torch.bfloat16, device=dev)
    S = torch.Size(shape)
    def checks():
        return all(type(t) is torch.Tensor and t.shape == S and t.is_cuda and t.get_device() == 0
                   and t.is_contiguous() for t in (q, k, v))
    graph = torch.cuda.CUDAGraph()
    for _ in range(3): p.run(q, k, v, g, out=o)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        p.run(q, k, v, g, out=o)
    cases = {"sync_only": lambda: None, "empty_alloc": empty_alloc, "checks": checks,
             "raw1": raw1, "raw1_extra": raw1_extra, "raw2": raw2, "raw2_side": raw2_side,
             "bound": bound, "run": lambda: p.run(q, k, v, g),
             "run_out": lambda: p.run(q, k, v, g, out=o),
             "run_general": lambda: p._run_general(q, k, v, g), "graph": graph.replay}
    rows = {}
    for name, fn in cases.items():
        h, e = host_e2e(fn)
        rows[name] = {"us_host": h, "us_e2e": e}
    rows["gpu_graph"] = gpu(graph.replay)
    rows["gpu_raw1"] = gpu(raw1)
    rows["gpu_raw1_extra"] = gpu(raw1_extra)
    # raw1_extra must compute what raw1 does: compare the workspace after each
    ws = p.finish_exec.workspaces
    raw1(); torch.cuda.synchronize(); a = {n: t.clone() for n, t in ws.items()}
    for t in ws.values(): t.zero_()
    raw1_extra(); torch.cuda.synchronize()
    rows["extra_matches"] = all(torch.equal(a[n], ws[n]) for n in ws)
    out["rows"][T] = rows
    print(T, json.dumps(rows, indent=1), flush=True)
dst = Path(os.environ.get("OUT", "/tmp")) / "launch_floor_s26.json"
dst.write_text(json.dumps(out, indent=1))

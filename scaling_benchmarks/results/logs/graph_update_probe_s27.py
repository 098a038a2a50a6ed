# Session 27 probe, kept with its output (graph_update_probe_NVIDIA-H200_2026-11-25_s27.json): run on one H200 (torch 2.11, triton 3.6)
# from the repo root of the tree of commit efd2cf3, pinned with taskset -c 3.
"""Device probe: a static plan's launches as one CUDA graph whose kernel-node parameters are
updated per call (cuGraphExecKernelNodeSetParams_v2) and launched with one cuGraphLaunch,
against plan.run, raw cuLaunchKernel pairs and a plain graph replay.  Also: the GPU gap
between the plan's two kernels (torch.profiler), and the host cost of the pieces."""
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scaling_benchmarks.launch_overhead import (B, H, K, V, _events, _host_and_e2e,  # noqa
                                                make_inputs)
from forge_dist.runtime import aot, plan  # noqa
from forge_dist.runtime.dispatcher import CtypesDriver, Dispatcher  # noqa


class KNP2(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gx", ctypes.c_uint), ("gy", ctypes.c_uint),
                ("gz", ctypes.c_uint), ("bx", ctypes.c_uint), ("by", ctypes.c_uint),
                ("bz", ctypes.c_uint), ("shared", ctypes.c_uint),
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


L = ctypes.CDLL("libcuda.so.1")
vp = ctypes.c_void_p
L.cuGraphCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
L.cuGraphAddKernelNode_v2.argtypes = [ctypes.POINTER(vp), vp, ctypes.POINTER(vp), ctypes.c_size_t,
                                      ctypes.POINTER(KNP2)]
L.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
L.cuGraphExecKernelNodeSetParams_v2.argtypes = [vp, vp, ctypes.POINTER(KNP2)]
L.cuGraphLaunch.argtypes = [vp, vp]


def ck(rc, what):
    if rc:
        raise RuntimeError(f"{what}: {rc}")


class GraphRun:
    """plan.run's checks are not here: only what the graph path adds or removes."""

    def __init__(self, bound_pl, q, k, v, g, out):
        b = bound_pl.bind(q, k, v, g, out=out)
        self.bound = b
        self.knp = []
        graph = vp()
        ck(L.cuGraphCreate(ctypes.byref(graph), 0), "create")
        prev = None
        self.nodes = []
        for fn, head, pack in b._steps:
            f, grid, bx, shared = head
            p = KNP2(f, grid[0], grid[1], grid[2], bx, 1, 1, shared, pack.params_address, None,
                     None, None)
            node = vp()
            deps = (vp * 1)(prev) if prev is not None else None
            ck(L.cuGraphAddKernelNode_v2(ctypes.byref(node), graph, deps, 1 if prev else 0,
                                         ctypes.byref(p)), "add")
            self.knp.append((p, pack))
            self.nodes.append(node)
            prev = node
        self.exec = vp()
        ck(L.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, 0), "inst")
        self.set = L.cuGraphExecKernelNodeSetParams_v2
        self.launch = L.cuGraphLaunch
        self.refs = [ctypes.byref(p) for p, _ in self.knp]

    def __call__(self, stream, values):
        for (p, pack), node, ref, vals in zip(self.knp, self.nodes, self.refs, values):
            pack.struct.pack_into(pack.buffer, 0, *vals)
            self.set(self.exec, node, ref)
        self.launch(self.exec, stream)


def gaps(fn, n=50):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type.name == "CUDA"
                 and "kernel" in e.name.lower() or "walk" in e.name],
                key=lambda e: e.time_range.start)
    ks = [e for e in ev if "walk" in e.name]
    gs, durs = [], []
    for a, b in zip(ks[::2], ks[1::2]):
        gs.append(b.time_range.start - a.time_range.end)
        durs.append((a.time_range.end - a.time_range.start, b.time_range.end - b.time_range.start))
    return (statistics.median(gs) if gs else None,
            [statistics.median(d[0] for d in durs), statistics.median(d[1] for d in durs)] if durs else None)


def main():
    out_dir = Path(os.environ.get("OUT", "out"))
    dev = torch.device("cuda", 0)
    cache_dir = Path.home() / ".cache" / "forge_dist" / "aot_probe"
    cfg = dict(variants=["simple_gla"], heads=[H], head_dims=[[K, V]], dtypes=["bfloat16"],
               execution=["decoupled"], initial_state=[False], sequence_parallel=False)
    aot.compile_all(cfg, target="cuda:90", cache_dir=cache_dir)
    cache = aot.CubinCache(cache_dir, "cuda:90")
    rows = []
    stream_fn = lambda: torch.cuda.current_stream().cuda_stream  # noqa
    for rep in range(3):
        for T in (1024, 2048, 4096, 8192):
            q, k, v, g = make_inputs(T, dev)
            common = dict(B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device=dev,
                          execution="decoupled")
            pl = plan("simple_gla", backend="static", dispatcher=Dispatcher(cache, CtypesDriver()),
                      **common)
            o_fixed = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)
            gr = GraphRun(pl, q, k, v, g, o_fixed)
            st = stream_fn()
            steps = gr.bound._steps
            base_vals = [list(pack.unpack()) for _, _, pack in steps]
            # which slots hold o's pointer (the per-call allocation changes it)
            optr = o_fixed.data_ptr()
            o_slots = [[i for i, x in enumerate(vals) if x == optr] for vals in base_vals]

            def graph_update():
                o = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)
                p = o.data_ptr()
                vals = [list(bv) for bv in base_vals]
                for vs, sl in zip(vals, o_slots):
                    for i in sl:
                        vs[i] = p
                gr(st, vals)
                return o

            def graph_update_fixed():
                gr(st, base_vals)

            raw = [(launch, (*head, st, pack.params_address)) for launch, head, pack in steps]

            def raw_launch():
                for launch, a in raw:
                    launch(*a)

            def run():
                return pl.run(q, k, v, g)

            tg = torch.cuda.CUDAGraph()
            for _ in range(3):
                pl.run(q, k, v, g, out=o_fixed)
            torch.cuda.synchronize()
            with torch.cuda.graph(tg):
                pl.run(q, k, v, g, out=o_fixed)
            # correctness: the updated graph writes what run() writes
            ref = run()[0]
            got = graph_update()
            torch.cuda.synchronize()
            same = bool(torch.equal(ref, got))
            paths = {"run": run, "graph_update": graph_update,
                     "graph_update_fixed": graph_update_fixed, "raw_launch": raw_launch,
                     "torch_graph": tg.replay,
                     "empty_only": lambda: torch.empty(B, T, H, V, dtype=torch.bfloat16, device=dev)}
            kern = _events(tg.replay, 200)
            row = {"T": T, "rep": rep, "same_as_run": same, "us_kernel": kern}
            for name, fn in paths.items():
                for _ in range(20):
                    fn()
                host, e2e, _ = _host_and_e2e(fn, 300)
                row[name] = {"host": host, "e2e": e2e, "ovh": e2e - kern}
            # host cost of one SetParams
            p0, pack0 = gr.knp[0]
            t0 = time.perf_counter()
            for _ in range(2000):
                gr.set(gr.exec, gr.nodes[0], gr.refs[0])
            row["us_setparams"] = (time.perf_counter() - t0) / 2000 * 1e6
            if rep == 0:
                row["gap_run"] = gaps(run)
                row["gap_graph_update"] = gaps(graph_update)
            rows.append(row)
            print(json.dumps({k_: (v_ if not isinstance(v_, dict) else
                                   {a: round(b, 2) for a, b in v_.items()})
                              for k_, v_ in row.items()}), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "graph_update_probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
        indent=1))


if __name__ == "__main__":
    main()

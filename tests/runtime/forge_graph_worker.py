"""torchrun worker for tests/runtime/test_gpu.py::test_forge_graph_replays.

    torchrun --nproc_per_node 2 tests/runtime/forge_graph_worker.py OUT_DIR

Each rank plans simple_gla with strategy="forge" (static backend where cubins exist, JIT
otherwise), captures one plan.run in a CUDA graph, then replays it 1000 times; before each
replay it copies one of 4 input sets (cycling, so consecutive replays differ) into the
captured inputs and compares the outputs with the eager ``ops.simple_gla`` (serial strategy)
of that set.  Writes ``OUT_DIR/rank<r>.json`` = ``{"ok", "detail"}``.
"""
import json
import os
import sys
import traceback

import forge_dist.comm  # noqa: F401  (environment defaults before NCCL/NVSHMEM start)
import torch
import torch.distributed as dist

from forge_dist import ops
from forge_dist.comm import nvshmem
from forge_dist.runtime import plan
from forge_dist.sp import forge

B, T, H, K, V, REPLAYS = 1, 2048, 8, 128, 128, 1000


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def inputs(seed, rank, device):
    gen = torch.Generator(device=device).manual_seed(1000 * seed + rank)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, d).to(torch.bfloat16) for d in (K, K, V))
    return [q, k, v, torch.nn.functional.logsigmoid(r(B, T, H) + 4)]


def main():
    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    report = {"ok": False, "detail": ""}
    try:
        nvshmem.setup(dist.group.WORLD)
        p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device=device,
                 group=dist.group.WORLD, strategy="forge", output_final_state=True)
        sets = [inputs(s, rank, device) for s in range(4)]
        refs = [ops.simple_gla(*x, group=dist.group.WORLD, strategy="serial",
                               output_final_state=True) for x in sets]
        static_in = [t.clone() for t in sets[0]]
        out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            p.run(*static_in, out=out)
        torch.cuda.synchronize()
        forge.flush(wait=True)  # no pending error event may be queried during capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, ht = p.run(*static_in, out=out)
        worst = 0.0
        for i in range(REPLAYS):
            for dst, src in zip(static_in, sets[i % 4]):
                dst.copy_(src)
            dist.barrier()  # both ranks' inputs are in place before either replays
            graph.replay()
            torch.cuda.synchronize()
            err = max(rel(out, refs[i % 4][0]), rel(ht, refs[i % 4][1]))
            worst = max(worst, err)
            if err > 5e-3:
                raise AssertionError(f"replay {i}: rel error {err:.3g} (set {i % 4})")
        report = {"ok": True, "detail": f"{REPLAYS} replays, worst rel error {worst:.3g}, "
                                        f"plan {p!r}"}
    except Exception as err:  # noqa: BLE001 - report to the test
        report = {"ok": False, "detail": f"{type(err).__name__}: {err}\n"
                                         f"{traceback.format_exc()[-2000:]}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

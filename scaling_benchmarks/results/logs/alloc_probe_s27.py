# Session 27 probe, kept with its output (alloc_probe_NVIDIA-H200_2026-11-25_s27.json): run on one H200 (torch 2.11, triton 3.6)
# from the repo root of the tree of commit efd2cf3, pinned with taskset -c 3.
import timeit, torch, json, os
dev = torch.device("cuda", 0)
q = torch.empty(1, 1024, 32, 128, dtype=torch.bfloat16, device=dev)
shape = (1, 1024, 32, 128); flat = 1024 * 32 * 128
from torch import empty, bfloat16
env = dict(torch=torch, q=q, shape=shape, dev=dev, empty=empty, bf=bfloat16, flat=flat,
           idx=0, ES=torch.empty_strided, stride=q.stride())
res = {}
for stmt in ["empty(shape, dtype=bf, device=dev)", "empty(shape, dtype=bf, device=0)",
             "empty(*shape, dtype=bf, device=dev)", "q.new_empty(shape)", "torch.empty_like(q)",
             "ES(shape, stride, dtype=bf, device=dev)", "empty(flat, dtype=bf, device=dev).view(shape)",
             "torch.cuda.current_stream().cuda_stream", "torch._C._cuda_getCurrentRawStream(0)",
             "q.data_ptr()", "torch.cuda.synchronize()"]:
    for _ in range(1000): eval(stmt, env)
    r = min(timeit.repeat(stmt, globals=env, number=20000, repeat=5)) / 20000 * 1e6
    res[stmt] = round(r, 3); print(f"{r:7.3f} us  {stmt}", flush=True)
out = os.environ.get("OUT", "."); json.dump(res, open(f"{out}/alloc_probe.json", "w"), indent=1)

"""Which delta-rule backward launch faults, at which head dims (one case per process)."""
import os, sys, subprocess, torch, torch.nn.functional as F
if len(sys.argv) == 1:
    for dt in ("float32", "bfloat16"):
        for K, V in ((16, 16), (16, 32), (32, 16), (32, 32), (32, 64), (64, 32), (64, 64), (16, 128), (128, 16)):
            for T in (80, 128):
                r = subprocess.run([sys.executable, __file__, dt, str(K), str(V), str(T)], capture_output=True, text=True, timeout=120)
                print(dt, K, V, T, (r.stdout.strip().splitlines() or ["?"])[-1], flush=True)
    sys.exit()
from forge_dist.runtime import programs
from forge_dist.kernels import delta_backward as m
dt, K, V, T = getattr(torch, sys.argv[1]), *map(int, sys.argv[2:])
orig = programs.Program.execute
def execute(self, tensors, device):
    allocate_at, free_at = self.lifetimes()
    for ln, new, done in zip(self.launches, allocate_at, free_at):
        for name in new:
            if name not in tensors:
                b = self.buffers[name]; tensors[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        call = {n: tensors[v] if k == "buf" else v for n, k, v in ln.args}
        try:
            programs.resolve_kernel(ln.kernel)[ln.grid](**call, **dict(ln.constexprs), num_warps=ln.num_warps, num_stages=ln.num_stages)
            torch.cuda.synchronize()
        except Exception as e:
            print("FAULT in", ln.kernel, ln.grid, dict(ln.constexprs).get("BK"), dict(ln.constexprs).get("BV"), ln.num_warps, type(e).__name__, flush=True); sys.exit(1)
        for n in done: del tensors[n]
    return tensors
programs.Program.execute = execute
B, H = 1, 2
gen = torch.Generator().manual_seed(3)
r = lambda *s: torch.randn(*s, generator=gen).cuda()
q, k, v = r(B,T,H,K).to(dt), F.normalize(r(B,T,H,K), dim=-1).to(dt), r(B,T,H,V).to(dt)
g = F.logsigmoid(r(B,T,H) + 2); beta = torch.rand(B,T,H, generator=gen).cuda()
m.delta_rule_backward(q, k, v, g, beta, r(B,H,K,V), r(B,T,H,V).to(dt), r(B,H,K,V), K ** -0.5)
torch.cuda.synchronize()
print("ok")

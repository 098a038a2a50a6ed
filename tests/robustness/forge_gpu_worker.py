"""Robustness of the forge strategy on real GPUs (NVSHMEM); run under torchrun.

    torchrun --nproc_per_node 2 tests/robustness/forge_gpu_worker.py OUT_DIR [N_CALLS]

Every rank writes ``OUT_DIR/rank<r>.json`` = ``{check: {"ok", "detail", ...}}`` and prints
one line per check; ``tests/robustness/test_forge_gpu.py`` launches it and asserts them.
Checks, in this order:

* ``load``: ``N_CALLS`` (default 10,000) back-to-back forward and backward chains, shapes
  and transition kinds cycling through :data:`SHAPES`, every call with its own data and
  checked on the device against a fold of all ranks' data (no host sync per call); per
  window of 1,000 calls the wall time and the allocated memory, which may not grow;
* ``determinism``: two fwd+bwd runs of every op with ``strategy="forge"`` give bitwise
  equal outputs, final states and input gradients;
* ``stall_fwd`` / ``stall_bwd`` / ``cut_mid_stream``: rank 0 skips a forward call, the last
  rank skips a backward call, rank 0's kernel sends only the first half of its tiles; the
  waiting neighbour raises ``StatePassTimeout`` naming itself, the peer, a tile and the call
  within the bound (2 s + slack); then every rank calls ``forge.reset()`` and the next call
  is correct again;
* ``lag``: rank 1 makes its call 2 only after rank 0's call 3 gave up waiting for its
  credit; rank 1 must raise (the signal is a later call's), not take a tile;
* ``crash``: the last rank writes its report and exits in the middle of the job (before
  its backward); rank P-2 names it within the bound.  Nothing runs after this check.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import forge_dist.comm  # noqa: F401  (environment defaults before NCCL/NVSHMEM start)
import torch
import torch.distributed as dist

from forge_dist import ops
from forge_dist.comm import nvshmem
from forge_dist.sp import forge
from forge_dist.sp.p2p import StatePassTimeout
from forge_dist.variants import transitions as tr
from forge_dist.variants.transitions import Kind

BOUND_S = 2.0
SLACK_S = 8.0  # launch, compile of a new grid, the host's lazy read
RESULTS: dict = {}
# (kind, B, H, K, V, direction): a bounded set of shapes; each is its own channel
SHAPES = [
    (Kind.SCALAR, 1, 4, 64, 64, "fwd"),
    (Kind.DIAGONAL, 2, 4, 64, 128, "fwd"),
    (Kind.DENSE, 1, 2, 128, 128, "fwd"),
    (Kind.IDENTITY, 1, 8, 32, 64, "fwd"),
    (Kind.SCALAR, 1, 4, 64, 64, "bwd"),
    (Kind.DIAGONAL, 1, 2, 128, 64, "bwd"),
    (Kind.DENSE, 1, 2, 64, 96, "bwd"),
]


def _then_recover(fn):
    """Run a fault scenario; whatever it raised, every rank still resets and checks one
    call (so a failed scenario does not leave its peers waiting in the next one)."""
    def run(group, device):
        try:
            result = fn(group, device)
        finally:
            _recover(group, device)
        return result + "; recovered after reset"
    return run


def check(name):
    def deco(fn):
        def run(*a, **k):
            print(f"[rank {dist.get_rank()}] {name}: start", flush=True)
            t = time.time()
            try:
                out = fn(*a, **k) or {}
                out = out if isinstance(out, dict) else {"detail": out}
                RESULTS[name] = {"ok": True, **out,
                                 "detail": f"{out.get('detail', '')} ({time.time() - t:.1f}s)"}
            except Exception as err:  # noqa: BLE001 - report, keep going
                RESULTS[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}\n"
                                 f"{traceback.format_exc()[-1500:]}"}
            print(f"[rank {dist.get_rank()}] {name}: {RESULTS[name]['ok']} "
                  f"{RESULTS[name]['detail'][:400]}", flush=True)
        return run
    return deco


def _transitions(kind, B, H, K, P, device, seed):
    """Every rank's transition (the same on all ranks: each can fold the whole chain)."""
    gen = torch.Generator().manual_seed(seed)
    Ms = []
    for _ in range(P):
        if kind is Kind.IDENTITY:
            Ms.append(None)
        elif kind is Kind.SCALAR:
            Ms.append((torch.rand(B, H, generator=gen) * 0.5 + 0.5).to(device))
        elif kind is Kind.DIAGONAL:
            Ms.append((torch.rand(B, H, K, generator=gen) * 0.5 + 0.5).to(device))
        else:
            Ms.append((torch.randn(B, H, K, K, generator=gen) / K ** 0.5).to(device))
    return Ms


class _Case:
    """One shape of the load: fixed base tensor and transitions; data vary per call."""

    def __init__(self, idx, kind, B, H, K, V, direction, P, device):
        self.kind, self.direction, self.P = kind, direction, P
        gen = torch.Generator().manual_seed(100 + idx)
        self.base = torch.randn(B, H, K, V, generator=gen).to(device)
        self.Ms = _transitions(kind, B, H, K, P, device, 200 + idx)

    def data(self, call, r):
        """Rank ``r``'s summary (forward) or state gradient (backward) of call ``call``."""
        return self.base * math.cos(0.37 * call + r + 1)

    def run(self, call, r, group):
        M = self.Ms[r] if r < self.P - 1 else None
        if self.direction == "fwd":
            S0 = self.base * math.sin(0.11 * call) if r == 0 else torch.zeros_like(self.base)
            return forge.FORGE.forward_chain(self.kind, M, self.data(call, r), S0, group)[0]
        return forge.FORGE.backward_chain(self.kind, M, self.data(call, r), group, None)[1]

    def expected(self, call, r):
        if self.direction == "fwd":
            S = self.base * math.sin(0.11 * call)
            for s in range(r):
                S = tr.combine(self.kind, self.Ms[s], S, self.data(call, s))
            return S
        lam = torch.zeros_like(self.base)
        for s in reversed(range(r, self.P)):
            lam = self.data(call, s) + (tr.apply_transposed(self.kind, self.Ms[s], lam)
                                        if s < self.P - 1 else 0)
        return lam


def load(group, device, n_calls):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    cases = [_Case(i, *s, P, device) for i, s in enumerate(SHAPES)]
    errs = torch.zeros(n_calls, dtype=torch.float32, device=device)
    window = 1000
    windows = []
    dist.barrier(group)
    torch.cuda.synchronize()
    t = time.time()
    for i in range(n_calls):
        case = cases[i % len(cases)]
        got = case.run(i, r, group)
        want = case.expected(i, r)
        errs[i] = (got - want).norm() / want.norm().clamp_min(1e-30)
        del got, want  # window edges see the same live tensors whatever the shape
        if (i + 1) % window == 0:
            torch.cuda.synchronize()
            now = time.time()
            windows.append({"calls": i + 1, "s": round(now - t, 4),
                            "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 3)})
            print(f"[rank {r}] load: {windows[-1]}", flush=True)
            t = now
    torch.cuda.synchronize()
    forge.flush(wait=True)
    bad = (errs > 1e-4).nonzero().flatten().tolist()  # dense: 3xTF32 (fp32-level)
    nan = int(torch.isnan(errs).sum())
    detail = (f"{n_calls} calls over {len(SHAPES)} shapes, worst rel error "
              f"{float(errs.max()):.2e}, windows of {window}: "
              f"{[w['s'] for w in windows]} s, allocated {[w['allocated_mib'] for w in windows]}"
              f" MiB, peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    if bad or nan:
        raise AssertionError(f"{len(bad)} wrong calls (first {bad[:5]}), {nan} NaN; {detail}")
    steady = windows[1:] if len(windows) > 1 else windows
    if len({w["allocated_mib"] for w in steady}) != 1:
        raise AssertionError(f"allocated memory changed between windows: {detail}")
    if len(steady) > 1 and steady[-1]["s"] > 1.5 * steady[0]["s"] + 0.05:
        raise AssertionError(f"slow-down: last window {steady[-1]['s']}s vs "
                             f"{steady[0]['s']}s; {detail}")
    return {"detail": detail, "windows": windows, "worst_rel_err": float(errs.max())}


def determinism(group, device):
    r = dist.get_rank(group)
    B, T, H, K, V = 1, 1024, 4, 64, 64
    out = []
    for op in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
        prints = []
        for _ in range(2):
            gen = torch.Generator(device=device).manual_seed(7 + r)
            rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
            if op == "hgrn":
                x = rnd(B, T, 128).to(torch.bfloat16).requires_grad_()
                g = torch.nn.functional.logsigmoid(rnd(B, T, 128) + 3).requires_grad_()
                leaves = [x, g]
                o, ht = ops.hgrn(x, g, group=group, strategy="forge", output_final_state=True)
            else:
                q, k, v = (rnd(B, T, H, d).to(torch.bfloat16).requires_grad_()
                           for d in (K, K, V))
                k2 = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
                leaves = [q, k, v]
                kw = dict(group=group, strategy="forge", output_final_state=True)
                if op == "linear_attn":
                    o, ht = ops.linear_attn(q, k, v, **kw)
                elif op == "simple_gla":
                    g = torch.nn.functional.logsigmoid(rnd(B, T, H) + 3).requires_grad_()
                    leaves.append(g)
                    o, ht = ops.simple_gla(q, k, v, g, **kw)
                elif op == "gla":
                    g = torch.nn.functional.logsigmoid(rnd(B, T, H, K) + 3).requires_grad_()
                    leaves.append(g)
                    o, ht = ops.gla(q, k, v, g, **kw)
                else:
                    g = torch.nn.functional.logsigmoid(rnd(B, T, H) + 3).requires_grad_()
                    beta = torch.rand(B, T, H, device=device, generator=gen).requires_grad_()
                    leaves += [g, beta]
                    o, ht = ops.gated_delta_rule(q, k2, v, g, beta, **kw)
            (o.float().square().sum() + ht.square().sum()).backward()
            prints.append([o.detach().clone(), ht.detach().clone()]
                          + [x.grad.clone() for x in leaves])
        same = all(torch.equal(a, b) for a, b in zip(*prints))
        if not same:
            raise AssertionError(f"{op}: two identical forge fwd+bwd runs differ bitwise")
        out.append(op)
    return f"bitwise equal across two runs: {out}"


def _small(device):
    B, H, K, V = 1, 4, 64, 128  # scalar kind: 8 tiles of 64 x 64
    d = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(5)).to(device)
    M = torch.full((B, H), 0.5, device=device)
    return d, M


def _expect_timeout(fn, pattern_parts):
    t = time.time()
    try:
        fn()
        torch.cuda.synchronize()
        forge.flush(wait=True)
    except StatePassTimeout as err:
        took = time.time() - t
        msg = str(err)
        missing = [p for p in pattern_parts if p not in msg]
        if missing:
            raise AssertionError(f"message lacks {missing}: {msg}")
        if took > BOUND_S + SLACK_S:
            raise AssertionError(f"took {took:.1f}s for a {BOUND_S}s bound: {msg}")
        return took, msg
    raise AssertionError("no StatePassTimeout")


def _recover(group, device):
    """Every rank resets its channels; then one forward chain must be right again."""
    forge.reset()
    torch.cuda.synchronize()
    dist.barrier(group)
    r, P = dist.get_rank(group), dist.get_world_size(group)
    d, M = _small(device)
    S0 = d * 2 if r == 0 else torch.zeros_like(d)
    got = forge.FORGE.forward_chain(Kind.SCALAR, M if r < P - 1 else None, d + r, S0, group)[0]
    want = d * 2
    for s in range(r):
        want = 0.5 * want + d + s
    torch.cuda.synchronize()
    forge.flush(wait=True)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise AssertionError("after reset the next call is wrong")
    dist.barrier(group)


def _fwd(group, device, send=True):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    d, M = _small(device)
    return forge.FORGE.forward_chain(Kind.SCALAR, M if r < P - 1 else None, d,
                                     torch.zeros_like(d), group)


def stall_fwd(group, device):
    r = dist.get_rank(group)
    _fwd(group, device)  # allocates the channel (a collective) on every rank
    torch.cuda.synchronize()
    dist.barrier(group)
    if r == 0:
        result = "rank 0 skipped its send"
    else:
        took, msg = _expect_timeout(lambda: _fwd(group, device),
                                    [f"rank {r} gave up", f"from rank {r - 1}", "tile",
                                     "incoming state"] if r == 1 else [f"rank {r}"])
        result = f"raised after {took:.2f}s: {msg}"
    return result


def lag(group, device):
    """Rank 1 falls more than the bound behind: rank 0 makes calls 2 and 3 first.  Call 3's
    credit wait runs out (rank 0 names rank 1); rank 1's late call 2 then finds a later
    call's signal and must fail ("already belongs to a later call"), never return a tile."""
    r = dist.get_rank(group)
    _fwd(group, device)  # call 1 on every rank (allocates the channel)
    torch.cuda.synchronize()
    dist.barrier(group)
    if r == 0:
        _fwd(group, device)  # call 2: its credit (call 1's) is there
        took, msg = _expect_timeout(lambda: _fwd(group, device),
                                    ["rank 0 gave up", "rank 1 to free its receive slot"])
        result = f"call 3 raised after {took:.2f}s: {msg}"
    dist.barrier(group)  # rank 1 wakes only after rank 0's call 3 gave up
    if r == 1:
        took, msg = _expect_timeout(lambda: _fwd(group, device),
                                    ["rank 1", "from rank 0", "already belongs to a later call"])
        result = f"late call 2 raised after {took:.2f}s: {msg}"
    elif r > 1:
        took, msg = _expect_timeout(lambda: _fwd(group, device), [f"rank {r}"])
        result = f"raised after {took:.2f}s: {msg}"
    return result


def _backward_after_a_good_one(group, device):
    """One good backward chain on every rank (it allocates the channel, a collective), then
    the function that makes the next one."""
    r, P = dist.get_rank(group), dist.get_world_size(group)
    d, M = _small(device)

    def run():
        return forge.FORGE.backward_chain(Kind.SCALAR, M if r < P - 1 else None, d, group,
                                          None)
    run()
    torch.cuda.synchronize()
    dist.barrier(group)
    return r, P, run


def stall_bwd(group, device):
    r, P, run = _backward_after_a_good_one(group, device)
    if r == P - 1:
        result = f"rank {r} skipped its backward"
    elif r == P - 2:
        took, msg = _expect_timeout(run, [f"rank {r} gave up", f"from rank {r + 1}", "tile",
                                          "state gradient"])
        result = f"raised after {took:.2f}s: {msg}"
    else:
        took, msg = _expect_timeout(run, [f"rank {r}"])
        result = f"raised after {took:.2f}s: {msg}"
    return result


class _HalfGrid:
    """Launches the chain kernel on the first half of its grid: a rank that stops sending
    in the middle of its tile stream (its epoch counter still advances)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.sent = None

    def __getitem__(self, grid):
        self.sent = grid[0] // 2
        return self.kernel[(self.sent,)]


def cut_mid_stream(group, device):
    r = dist.get_rank(group)
    _fwd(group, device)
    torch.cuda.synchronize()
    dist.barrier(group)
    if r == 0:
        real = forge._kernel
        half = _HalfGrid(real(forge.comm.NVSHMEM))
        forge._kernel = lambda transport: half
        try:
            _fwd(group, device)
            torch.cuda.synchronize()
        finally:
            forge._kernel = real
        result = f"rank 0 sent {half.sent} tiles of {2 * half.sent}"
    elif r == 1:
        took, msg = _expect_timeout(lambda: _fwd(group, device),
                                    ["rank 1 gave up", "from rank 0", "tile"])
        tile = int(msg.split(" tile ")[1].split()[0])
        if tile < 4:  # 8 tiles, the first 4 were sent
            raise AssertionError(f"named tile {tile}, which was sent: {msg}")
        result = f"raised after {took:.2f}s naming unsent tile {tile}: {msg}"
    else:
        took, msg = _expect_timeout(lambda: _fwd(group, device), [f"rank {r}"])
        result = f"raised after {took:.2f}s: {msg}"
    return result


def crash(group, device, out_dir):
    r, P, run = _backward_after_a_good_one(group, device)
    if r == P - 1:
        RESULTS["crash"] = {"ok": True, "detail": f"rank {r} exits before its backward"}
        _write(out_dir, r)
        os._exit(0)  # exit code 0: torchrun lets the other ranks finish their reports
    took, msg = _expect_timeout(run, [f"rank {r} gave up", "tile"] +
                                ([f"from rank {r + 1}"] if r == P - 2 else []))
    return f"rank {P - 1} died; raised after {took:.2f}s: {msg}"


def _write(out_dir, rank):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    n_calls = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    reason = forge.FORGE.available(device)
    if reason is not None:
        RESULTS["available"] = {"ok": False, "detail": reason}
    else:
        RESULTS["available"] = {"ok": True, "detail": f"{dist.get_world_size()} ranks"}
        nvshmem.setup(group)
        check("load")(load)(group, device, n_calls)
        check("determinism")(determinism)(group, device)
        dist.barrier(group)
        os.environ["FORGE_DIST_TIMEOUT"] = str(BOUND_S)
        check("stall_fwd")(_then_recover(stall_fwd))(group, device)
        check("stall_bwd")(_then_recover(stall_bwd))(group, device)
        check("cut_mid_stream")(_then_recover(cut_mid_stream))(group, device)
        check("lag")(_then_recover(lag))(group, device)
        check("crash")(crash)(group, device, out_dir)
    _write(out_dir, dist.get_rank())
    os._exit(0)  # no teardown: a peer is gone and NVSHMEM's finalize would wait for it


if __name__ == "__main__":
    main()

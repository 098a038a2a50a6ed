"""Multi-GPU checks of the forge strategy; run under torchrun (see run_multigpu.sh).

    torchrun --nproc_per_node 2 tests/comm/multigpu_worker.py OUT_DIR

Every rank writes ``OUT_DIR/rank<r>.json``: ``{check: {"ok": bool, "detail": str}}``;
``tests/sp/test_forge_multigpu.py`` launches this and asserts every check on every rank.
Checks (in this order; the timeout check is last because it leaves the channel's epochs
out of step between ranks):

* ``chains_<kind>``: forge forward/backward chains equal a fold of all ranks' summaries and
  the serial and lasp2 strategies;
* ``op_<name>``: each op with group + strategy="forge" equals serial, lasp2 and the
  single-GPU op on the whole sequence, outputs and input gradients;
* ``plans`` / ``plans_delta``: sequence-parallel plans of every strategy against the op on
  one GPU (``plans_delta``: the delta rule's, from zero and from an initial state);
* ``back_to_back``: 1000 forward chains launched without host synchronisation, each with
  its own data, all correct (no stale signal, no overwritten slot);
* ``no_host_sync_<strategy>``: steady-state calls of every op (forward, and forward +
  backward) with a signature agreed earlier run under
  ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation fails the check;
* ``scan_chains_<kind>``, ``scan_op_<name>``, ``no_host_sync_scan``: the same for the
  log-depth strategy (its GPU-initiated rounds), apart so that its failure stands alone;
* ``hier_chains_<kind>``, ``hier_op_<name>``, ``no_host_sync_hier``: the same for the scan
  laid out by node, with two simulated nodes (``FORGE_DIST_RANKS_PER_NODE``);
* ``signature_on_device``: two signatures agreed, then the ranks pass different ones (no
  host collective runs): the receiving rank's output is NaN and ``sp.flush()`` raises an
  error naming the argument and both values;
* ``timeout``: rank 0 skips a call; rank 1 raises StatePassTimeout naming rank 1, rank 0
  and a tile, within the (short) bound.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import forge_dist.comm  # noqa: F401  (environment defaults before NCCL/NVSHMEM start)
import torch
import torch.distributed as dist

from forge_dist import ops, sp
from forge_dist.comm import nvshmem
from forge_dist.sp import forge, lasp2, serial  # noqa: F401
from forge_dist.sp import layout as sp_layout
from forge_dist.sp.p2p import StatePassTimeout
from forge_dist.variants import transitions as tr
from forge_dist.variants.transitions import Kind

RESULTS = {}


def check(name):
    def deco(fn):
        def run(*a, **k):
            t = time.time()
            try:
                detail = fn(*a, **k) or ""
                RESULTS[name] = {"ok": True, "detail": f"{detail} ({time.time() - t:.1f}s)"}
            except Exception as err:  # noqa: BLE001 - report, keep going
                RESULTS[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}\n"
                                 f"{traceback.format_exc()[-1500:]}"}
            print(f"[rank {dist.get_rank()}] {name}: {RESULTS[name]['ok']} "
                  f"{RESULTS[name]['detail'][:300]}", flush=True)
        return run
    return deco


def rel(a, b):
    """Relative error; a NaN or inf anywhere reads as inf, so ``max`` and ``>`` catch it."""
    e = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    return e if e == e else float("inf")


def summaries(kind, P, B, H, K, V, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Ms, ds = [], []
    for _ in range(P):
        if kind is Kind.IDENTITY:
            M = None
        elif kind is Kind.SCALAR:
            M = torch.rand(B, H, generator=g) * 0.5 + 0.5
        elif kind is Kind.DIAGONAL:
            M = torch.rand(B, H, K, generator=g) * 0.5 + 0.5
        else:
            M = torch.randn(B, H, K, K, generator=g) / K ** 0.5
        Ms.append(None if M is None else M.to(device))
        ds.append(torch.randn(B, H, K, V, generator=g).to(device))
    S0 = torch.randn(B, H, K, V, generator=g).to(device)
    gs = [torch.randn(B, H, K, V, generator=g).to(device) for _ in range(P)]
    return Ms, ds, S0, gs


def chain_check(kind, group, device, K=128, V=128, strategies=("forge", "serial", "lasp2")):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, H = 2, 4
    Ms, ds, S0, gs = summaries(kind, P, B, H, K, V, 11, device)
    M = Ms[r] if r < P - 1 else None
    S_ref, ins = S0, []
    for s in range(P):
        ins.append(S_ref)
        S_ref = tr.combine(kind, Ms[s], S_ref, ds[s])
    lam, lams = torch.zeros_like(S0), [None] * P
    for s in reversed(range(P)):
        nxt = lam
        lam = gs[s] + tr.apply_transposed(kind, Ms[s], nxt)
        lams[s] = (nxt, lam)
    S0_r = S0 if r == 0 else torch.zeros_like(S0)
    out = {}
    for name in strategies:
        strat = sp.resolve(name, device)
        S_in, saved = strat.forward_chain(kind, M, ds[r], S0_r, group)
        ln, lh = strat.backward_chain(kind, M, gs[r], group, saved)
        torch.cuda.synchronize()
        out[name] = (S_in, ln, lh)
    errs = []
    for name, (S_in, ln, lh) in out.items():
        errs += [rel(S_in, ins[r]), rel(lh, lams[r][1])]
        if r < P - 1:
            errs.append(rel(ln, lams[r][0]))
    for name in [s for s in ("serial", "lasp2") if s in out and "forge" in out]:
        errs.append(rel(out["forge"][0], out[name][0]))
        errs.append(rel(out["forge"][2], out[name][2]))
    worst = max(errs)
    if worst > 1e-5:
        raise AssertionError(f"{kind.value}: relative error {worst:.3g} > 1e-5 ({errs})")
    return f"max rel err {worst:.2e}"


def op_inputs(name, B, T, H, D, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rn(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)
    if name == "hgrn":  # slow decays: a rank's state reaches well into the next shard
        return {"x": rn(B, T, H * D),
                "g": -0.05 * torch.rand(B, T, H * D, generator=g).to(device)}
    q, k, v = rn(B, T, H, D), rn(B, T, H, D), rn(B, T, H, D)
    if name == "linear_attn":
        return {"q": q, "k": k * 0.1, "v": v}
    if name == "simple_gla":
        return {"q": q, "k": k, "v": v, "g": -torch.rand(B, T, H, generator=g).to(device)}
    if name == "gla":
        return {"q": q, "k": k, "v": v,
                "g": -0.2 * torch.rand(B, T, H, D, generator=g).to(device)}
    k = torch.nn.functional.normalize(k, dim=-1)
    return {"q": q, "k": k, "v": v, "g": -torch.rand(B, T, H, generator=g).to(device) * 0.2,
            "beta": torch.rand(B, T, H, generator=g).to(device)}


def call_op(name, inputs, **kw):
    fn = getattr(ops, name)
    if name == "hgrn":
        return fn(inputs["x"], inputs["g"], **kw)
    if name == "linear_attn":
        return fn(inputs["q"], inputs["k"], inputs["v"], **kw)
    if name == "gated_delta_rule":
        return fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], **kw)
    return fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], **kw)


def op_check(name, group, device, strategies=("forge", "serial", "lasp2")):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, T_local, H, D = 2, 64, 2, 32
    full = op_inputs(name, B, T_local * P, H, D, 5, device)
    results, w_full, nodes = {}, None, {}
    for strategy in ("single",) + tuple(strategies):
        if strategy == "single":
            inp = {k: v.clone().requires_grad_(True) for k, v in full.items()}
            o, fs = call_op(name, inp, output_final_state=True)
            sl = slice(r * T_local, (r + 1) * T_local)
            w_full = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)).to(device)
            w = w_full
        else:
            inp = {k: v[:, r * T_local:(r + 1) * T_local].clone().requires_grad_(True)
                   for k, v in full.items()}
            o, fs = call_op(name, inp, output_final_state=True, group=group,
                            strategy=strategy)
            sl = slice(None)
            w = w_full[:, r * T_local:(r + 1) * T_local]
        nodes[strategy] = type(o.grad_fn).__name__  # a training plan's, or the general path's
        loss = (o * w).sum()
        loss.backward()
        torch.cuda.synchronize()
        results[strategy] = (o[:, sl].detach(), {k: v.grad[:, sl] for k, v in inp.items()})
    errs = {}
    base_o, base_g = results["single"]
    for strategy in strategies:
        o, grads = results[strategy]
        errs[strategy] = max([rel(o, base_o)] + [rel(grads[k], base_g[k]) for k in grads])
    if "forge" in results and "serial" in results:
        errs["forge-vs-serial"] = max(
            [rel(results["forge"][0], results["serial"][0])]
            + [rel(results["forge"][1][k], results["serial"][1][k]) for k in base_g])
    if max(errs.values()) > 1e-4:
        raise AssertionError(f"{name}: relative errors {errs}")
    return " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + f" autograd nodes {nodes}"


def hgrn_mixed_check(group, device):
    """hgrn with bf16 x and fp32 gates (the benchmarks' inputs; the calls run the rank's
    plan and training plan, whose gate dtype differs from x's): forward and every gradient
    of forge, serial and lasp2 against the op on the whole sequence on one GPU, and forge
    against serial, to bf16 accuracy."""
    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, T_local, D = 2, 1000, 256
    full = op_inputs("hgrn", B, T_local * P, 1, D, 17, device)
    full["x"] = full["x"].bfloat16()
    full["g"] = full["g"] * 0.02  # decays over the whole shard, not its first tokens
    mine = slice(r * T_local, (r + 1) * T_local)
    w = torch.randn(B, T_local * P, D, generator=torch.Generator().manual_seed(3)).to(device)
    res = {}
    for strategy in ("single", "forge", "serial", "lasp2"):
        kw = {} if strategy == "single" else {"group": group, "strategy": strategy}
        sl = mine if strategy == "single" else slice(None)
        inp = {k: (v if strategy == "single" else v[:, mine]).clone() for k, v in full.items()}
        with torch.no_grad():
            for _ in range(3):  # the plan's steady state
                o_ng, _ = call_op("hgrn", inp, **kw)
        inp = {k: t.requires_grad_(True) for k, t in inp.items()}
        o, _ = call_op("hgrn", inp, **kw)
        node = type(o.grad_fn).__name__  # the plans ran, not the general path
        want = "_PlannedHgrnBackward" if strategy == "single" else "_PlannedSequenceParallelBackward"
        if node != want:
            raise AssertionError(f"{strategy}: the call ran {node}, expected {want}")
        (o.float() * (w if strategy == "single" else w[:, mine])).sum().backward()
        torch.cuda.synchronize()
        if inp["g"].grad.dtype != torch.float32:
            raise AssertionError(f"{strategy}: dg dtype {inp['g'].grad.dtype}, expected fp32")
        res[strategy] = [o_ng[:, sl], o[:, sl], inp["x"].grad[:, sl], inp["g"].grad[:, sl]]
    errs = {s: max(rel(a, b) for a, b in zip(res[s], res["single"]))
            for s in ("forge", "serial", "lasp2")}
    errs["forge-vs-serial"] = max(rel(a, b) for a, b in zip(res["forge"], res["serial"]))
    if max(errs.values()) > 2e-2 or errs["forge-vs-serial"] > 1e-3:
        raise AssertionError(f"hgrn bf16 x, fp32 g: relative errors {errs}")
    return " ".join(f"{k}={v:.1e}" for k, v in errs.items())


def plan_check(group, device):
    """Sequence-parallel plans (the forward path of no-grad op calls): every strategy and
    schedule against the op on the whole sequence on one GPU, and forge against serial."""
    from forge_dist.runtime import plan

    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, T_local, H, D = 2, 1000, 4, 64  # 1000: a partial last chunk on every rank
    errs = {}
    for name in ("linear_attn", "simple_gla", "gla"):
        mine = slice(r * T_local, (r + 1) * T_local)
        # three draws: each repeated run gets new inputs, so a kept buffer or replayed round
        # that sent the previous call's state would show
        draws = [op_inputs(name, B, T_local * P, H, D, 11 + 100 * i, device) for i in range(3)]
        refs = []
        with torch.no_grad():
            for full in draws:
                refs.append(call_op(name, full)[0][:, mine])
        for execution in ("fused", "decoupled"):
            outs = {}
            # (rank 0 from zero: scan's and hier's lean first send, scan's replayed moves)
            for strategy in ("forge", "serial", "lasp2", "pipelined", "scan", "hier"):
                p = plan(name, B=B, T=T_local, H=H, K=D, V=D, dtype=torch.float32,
                         device=device, group=group, strategy=strategy, execution=execution)
                names = p.input_names
                worst = 0.0
                for full, ref in zip(draws, refs):  # the steady state, fresh epochs
                    o, _ = p.run(*[full[n][:, mine].contiguous() for n in names])
                    worst = max(worst, rel(o, ref))
                torch.cuda.synchronize()
                if strategy == "scan" and "scan-launch-fwd" not in p._pass_keep:
                    # these kinds' rounds run in one kernel, kept after the first call: the
                    # later draws went through that relaunch
                    raise AssertionError(f"{name}/{execution}: scan kept no fused launch")
                outs[strategy] = o
                errs[f"{name}/{execution}/{strategy}"] = worst
            errs[f"{name}/{execution}/forge-vs-serial"] = rel(outs["forge"], outs["serial"])
    # hgrn (its folded summary; the last rank walks once, or decoupled as the others)
    full = op_inputs("hgrn", B, T_local * P, H, D, 13, device)
    mine = slice(r * T_local, (r + 1) * T_local)
    with torch.no_grad():
        ref, _ = call_op("hgrn", full)
    for execution in (None, "decoupled"):
        outs = {}
        for strategy in ("forge", "serial", "lasp2", "scan"):
            p = plan("hgrn", B=B, T=T_local, D=H * D, dtype=torch.float32, device=device,
                     group=group, strategy=strategy, execution=execution)
            for _ in range(3):
                o, _ = p.run(full["x"][:, mine].contiguous(), full["g"][:, mine].contiguous())
            torch.cuda.synchronize()
            outs[strategy] = o
            errs[f"hgrn/{execution}/{strategy}"] = rel(o, ref[:, mine])
        errs[f"hgrn/{execution}/forge-vs-serial"] = rel(outs["forge"], outs["serial"])
    # bf16, against the op in bf16 on one GPU
    full = op_inputs("simple_gla", B, T_local * P, H, D, 12, device)
    full = {n: (t.bfloat16() if n != "g" else t) for n, t in full.items()}
    mine = slice(r * T_local, (r + 1) * T_local)
    with torch.no_grad():
        ref, _ = call_op("simple_gla", full)
    p = plan("simple_gla", B=B, T=T_local, H=H, K=D, V=D, dtype=torch.bfloat16, device=device,
             group=group, strategy="forge", execution="fused")
    for _ in range(3):
        o, _ = p.run(*[full[n][:, mine].contiguous() for n in p.input_names])
    torch.cuda.synchronize()
    errs["simple_gla/bf16/fused/forge"] = rel(o, ref[:, mine])
    sp.flush()
    bad = {k: v for k, v in errs.items() if not v < (2e-2 if "bf16" in k else 1e-4)}
    if bad:
        raise AssertionError(f"relative errors {bad}")
    return f"{len(errs)} cases, largest {max(errs.values()):.1e}"


def plan_delta_check(group, device):
    """The delta rule's sequence-parallel plans (its dense summary walked in the program, in
    pieces on the side stream): every strategy, from a zero start (rank 0 walks no transition) and from an initial
    state (every rank before the last walks it from the identity), fp32 and bf16, against
    the op on the whole sequence on one GPU, and forge against serial."""
    from forge_dist.runtime import plan

    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, T_local, H, D = 2, 1000, 4, 64
    full = op_inputs("gated_delta_rule", B, T_local * P, H, D, 13, device)
    mine = slice(r * T_local, (r + 1) * T_local)
    h0 = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(3)).to(device)
    errs = {}
    for dtype, with_h0 in ((torch.float32, False), (torch.float32, True),
                           (torch.bfloat16, False), (torch.bfloat16, True)):
        x = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in full.items()}
        with torch.no_grad():
            ref, _ = call_op("gated_delta_rule", x, initial_state=h0 if with_h0 else None)
        ref = ref[:, mine].float()
        outs = {}
        for strategy in ("forge", "serial", "lasp2", "pipelined"):
            # the summary walks in 4 pieces on the side stream, as from 32K tokens by default
            os.environ["FORGE_DIST_DENSE_SUMMARY_PIECES"] = "4"
            try:
                p = plan("gated_delta_rule", B=B, T=T_local, H=H, K=D, V=D, dtype=dtype,
                         device=device, group=group, strategy=strategy,
                         initial_state=with_h0 and r == 0)
            finally:
                del os.environ["FORGE_DIST_DENSE_SUMMARY_PIECES"]
            for _ in range(3):  # repeated runs: the steady state, fresh epochs
                o, _ = p.run(*[x[n][:, mine].contiguous() for n in p.input_names],
                             initial_state=h0 if with_h0 and r == 0 else None)
            torch.cuda.synchronize()
            outs[strategy] = o.float()
            errs[f"{dtype}/{'h0' if with_h0 else 'zero'}/{strategy}"] = rel(o, ref)
        errs[f"{dtype}/{'h0' if with_h0 else 'zero'}/forge-vs-serial"] = rel(
            outs["forge"], outs["serial"])
    sp.flush()
    # bf16: the output's own rounding (the single-GPU op is bf16 too)
    bad = {k: v for k, v in errs.items() if not v < (2e-2 if "bfloat16" in k else 1e-4)}
    if bad:
        raise AssertionError(f"relative errors {bad}")
    worst = {}
    for k, v in errs.items():
        case = k.rsplit("/", 1)[0]
        worst[case] = max(worst.get(case, 0.0), v)
    return "largest per case: " + " ".join(f"{k}={v:.1e}" for k, v in worst.items())


def back_to_back(group, device, n_calls=1000):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, H, K, V = 1, 4, 64, 64
    kind = Kind.DIAGONAL
    M = torch.full((B, H, K), 0.5, device=device)
    base = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(1)).to(device)
    outs = []
    dist.barrier(group)
    t = time.time()
    for i in range(n_calls):
        delta = base * (i + 1) + r  # call- and rank-specific data
        S0 = base * (-i) if r == 0 else torch.zeros_like(base)
        S_in, _ = forge.FORGE.forward_chain(kind, M if r < P - 1 else None, delta, S0, group)
        outs.append(S_in)
    torch.cuda.synchronize()
    elapsed = time.time() - t
    forge.flush(wait=True)
    bad = []
    for i, S_in in enumerate(outs):
        S = base * (-i)
        for s in range(r):
            S = 0.5 * S + base * (i + 1) + s
        if rel(S_in, S) > 1e-5 if r > 0 else not torch.equal(S_in, S):
            bad.append(i)
    if bad:
        raise AssertionError(f"{len(bad)} of {n_calls} calls wrong, first {bad[:5]}")
    return f"{n_calls} calls in {elapsed:.2f}s, all correct"


def no_host_sync(group, device, strategy):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    B, T_local, H, D = 1, 256, 4, 64
    done = []
    for name in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
        full = op_inputs(name, B, T_local * P, H, D, 7, device)
        inp = {k: v[:, r * T_local:(r + 1) * T_local].clone().requires_grad_(True)
               for k, v in full.items()}
        for grad in (False, True):
            def call():
                with torch.set_grad_enabled(grad):
                    o, _ = call_op(name, inp, group=group, strategy=strategy)
                    if grad:
                        o.backward(torch.ones_like(o))
            call()  # agrees the signature (a host collective and its synchronisation)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    call()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            done.append(f"{name}{'+bwd' if grad else ''}")
    torch.cuda.synchronize()
    sp.flush()
    return f"no synchronisation in {len(done)} steady-state cases"


def signature_on_device(group, device):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    H, D = 2, 32
    full = {T: op_inputs("simple_gla", 1, T * P, H, D, 11, device) for T in (64, 128)}

    def call(T):
        inp = {k: v[:, r * T:(r + 1) * T] for k, v in full[T].items()}
        return call_op("simple_gla", inp, group=group, strategy="forge")[0]
    for T in (64, 128):  # both signatures agreed on every rank
        call(T)
    torch.cuda.synchronize()
    sp.flush()
    dist.barrier(group)
    mine = 64 if r == 0 else 128  # no host collective runs for either
    o = call(mine)
    torch.cuda.synchronize()
    try:
        sp.flush()
        error = None
    except sp.agreement.SignatureMismatch as err:  # an argument error, as on the host
        error = str(err)
    if r == 0:
        if error is not None or torch.isnan(o).any():
            raise AssertionError(f"rank 0 receives nothing and must be clean: {error}")
        result = "rank 0 clean"
    else:
        if not torch.isnan(o).any():
            raise AssertionError("rank 1's output of the mismatched call is not NaN")
        want = "T (tokens per rank): every rank must pass the same value, but this rank " \
               "has 128 and rank 0 has 64"
        if error is None or want not in error:
            raise AssertionError(f"unexpected error: {error}")
        result = error
    dist.barrier(group)
    for T in (64, 128):  # the group stays usable
        call(T)
    torch.cuda.synchronize()
    sp.flush()
    return result


def timeout_check(group, device):
    r, P = dist.get_rank(group), dist.get_world_size(group)
    os.environ["FORGE_DIST_TIMEOUT"] = "2"
    os.environ["FORGE_DIST_FORGE_CHECK"] = "sync"
    d = torch.randn(1, 2, 32, 32, device=device)
    M = torch.full((1, 2), 0.5, device=device)
    # One good call first: a new shape allocates the channel's symmetric buffers, which is
    # a collective; a rank that skips that call would hang its peer in the allocation.
    forge.FORGE.forward_chain(Kind.SCALAR, M if r < P - 1 else None, d, torch.zeros_like(d),
                              group)
    torch.cuda.synchronize()
    dist.barrier(group)
    if r == 0:
        return "rank 0 skipped its send"
    t = time.time()
    try:
        forge.FORGE.forward_chain(Kind.SCALAR, M if r < P - 1 else None, d,
                                  torch.zeros_like(d), group)
    except StatePassTimeout as err:
        msg = str(err)
        took = time.time() - t
        want = f"rank {r} gave up"
        if want not in msg or f"from rank {r - 1}" not in msg or "tile" not in msg:
            if not (r > 1 and "poisoned" in msg):
                raise AssertionError(f"unexpected message: {msg}")
        if took > 30:
            raise AssertionError(f"took {took:.1f}s for a 2s bound")
        return f"raised after {took:.1f}s: {msg}"
    raise AssertionError("no StatePassTimeout")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    reason = forge.FORGE.available(device)
    if reason is not None:
        RESULTS["available"] = {"ok": False, "detail": reason}
    else:
        RESULTS["available"] = {"ok": True, "detail": nvshmem.remote_transport()}
        nvshmem.setup(group)
        # FORGE_MG_CHECKS=a,b,... runs only those checks (a device call too short for all)
        only = [c for c in os.environ.get("FORGE_MG_CHECKS", "").split(",") if c]

        def run(name, fn, *args, **kwargs):
            if not only or name in only:
                check(name)(fn)(*args, **kwargs)
        for kind in Kind:
            run(f"chains_{kind.value}", chain_check, kind, group, device)
        run("chains_dense_K64_V96", chain_check, Kind.DENSE, group, device, 64, 96)
        for name in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
            run(f"op_{name}", op_check, name, group, device)
        run("plans", plan_check, group, device)
        run("hgrn_mixed", hgrn_mixed_check, group, device)
        run("plans_delta", plan_delta_check, group, device)
        run("back_to_back", back_to_back, group, device)
        for strategy in ("forge", "lasp2", "serial", "pipelined"):
            run(f"no_host_sync_{strategy}", no_host_sync, group, device, strategy)
        # the log-depth strategies: their own cases, so that a failure of one stands apart.
        # hier lays its rounds out on two "nodes" of this machine's ranks: on 2 GPUs (nodes of
        # one rank) only the round across nodes runs; the rounds in a node and the hand-back
        # into it need nodes of 2 or more (FORGE_MG_WORLD=4)
        os.environ.setdefault("FORGE_DIST_RANKS_PER_NODE", str(max(1, dist.get_world_size(group) // 2)))
        sp_layout.forget()  # read again on every rank (auto may have read one node before)
        for strategy in ("scan", "hier"):
            for kind in Kind:
                run(f"{strategy}_chains_{kind.value}", chain_check, kind, group, device,
                    strategies=(strategy,))
            for name in ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"):
                run(f"{strategy}_op_{name}", op_check, name, group, device,
                    strategies=(strategy,))
            run(f"no_host_sync_{strategy}", no_host_sync, group, device, strategy)
        dist.barrier(group)
        run("signature_on_device", signature_on_device, group, device)
        dist.barrier(group)
        run("timeout", timeout_check, group, device)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    # No barrier/destroy after the timeout check: the ranks' channels are out of step.
    os._exit(0)


if __name__ == "__main__":
    main()

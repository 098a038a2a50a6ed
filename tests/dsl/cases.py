"""Problems and checks shared by the DSL tests (importable by spawned gloo workers)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from forge_dist.dsl import builtins, library, references
from forge_dist.selftest import rel_err
from forge_dist.variants import reference as ref

STRATEGIES = ("serial", "pipelined", "lasp2")
NEW = ("elu_linear_attn", "retnet", "rg_lru")


def problem(name: str, T: int, *, varlen: bool, seed: int = 0, K: int = 6, V: int = 10,
            D: int = 7):
    """fp64 global inputs (by name, in call order), initial state, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, H = (1 if varlen else 2), 2
    if name in ("rg_lru", "hgrn"):
        x = {"x": rnd(B, T, D), "r": rnd(B, T, D), "i": rnd(B, T, D), "lam": rnd(B, T, D) + 2}
        if name == "hgrn":
            x = {"x": x["x"], "g": F.logsigmoid(x["r"] + 2)}
        state = (D,)
    else:
        x = {"q": rnd(B, T, H, K), "k": rnd(B, T, H, K), "v": rnd(B, T, H, V)}
        if name == "gated_delta_rule":
            x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
            x["g"] = F.logsigmoid(rnd(B, T, H) + 2)
            x["beta"] = torch.sigmoid(rnd(B, T, H))
        state = (H, K, V)
    cu = None
    if varlen:
        cu = torch.tensor(sorted({0, T, T // 3 - 1, T // 2 + 1, T // 2 + 2, (3 * T) // 4 + 1}))
    rows = B if cu is None else len(cu) - 1
    return x, rnd(rows, *state), cu


def op_of(name):
    return {**library.LIBRARY, **builtins.BUILTINS}[name]


def reference(name, x, h0, cu):
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    if name == "gated_delta_rule":
        return ref.gated_delta_rule_ref(*x.values(), **kw)
    if name == "hgrn":
        return ref.hgrn_ref(*x.values(), **kw)
    return getattr(references, name + "_ref")(*x.values(), **kw)


def run_case(name, strategy, varlen, *, group=None, T_local=20, dtype=torch.float64, seed=0):
    """Forward + backward of one variant on this rank's shard vs the fp64 reference.

    Returns relative errors of o, final state and every input gradient (collective)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    T = T_local * world
    x, h0, cu = problem(name, T, varlen=varlen, seed=seed)
    shard = slice(rank * T_local, (rank + 1) * T_local)
    mine = {k: t[:, shard].to(dtype).clone().requires_grad_() for k, t in x.items()}
    init = h0.to(dtype).clone().requires_grad_()
    o, final = op_of(name)(**mine, initial_state=init, output_final_state=True, cu_seqlens=cu,
                           group=group if world > 1 else None, strategy=strategy)
    gen = torch.Generator().manual_seed(seed + 7)
    w_o = torch.randn((o.shape[0], T) + o.shape[2:], generator=gen, dtype=torch.float64)
    w_s = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    owns_final = varlen or rank == world - 1
    loss = (o * w_o[:, shard].to(dtype)).sum()
    if owns_final:
        loss = loss + (final * w_s.to(dtype)).sum()
    loss.backward()

    master = {k: t.clone().requires_grad_() for k, t in x.items()}
    h0m = h0.clone().requires_grad_()
    o_ref, f_ref = reference(name, master, h0m, cu)
    ((o_ref * w_o).sum() + (f_ref * w_s).sum()).backward()

    def gather(t):
        if world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    def total(t):
        if world > 1:
            t = t.clone()
            dist.all_reduce(t, group=group)
        return t

    errs = {"o": rel_err(gather(o.detach()), o_ref)}
    if varlen:
        errs["final_state"] = rel_err(total(final.detach()), f_ref)
    else:
        last = final.detach().clone()
        if world > 1:
            dist.broadcast(last, src=world - 1, group=group)
        errs["final_state"] = rel_err(last, f_ref)
    for k, t in mine.items():
        errs["d" + k] = rel_err(gather(t.grad), master[k].grad)
    g0 = init.grad if init.grad is not None else torch.zeros_like(init)
    errs["d_initial_state"] = rel_err(total(g0), h0m.grad)
    return errs


def world_rows(group, names, strategies=STRATEGIES):
    """Every (variant, strategy, layout) on ``group``; JSON-able rows."""
    rows = []
    for name in names:
        for strategy in strategies:
            for varlen in (False, True):
                rows.append({"name": name, "strategy": strategy, "varlen": varlen,
                             "errors": run_case(name, strategy, varlen, group=group)})
    return rows

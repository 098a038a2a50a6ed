"""Cross-checks of every op and strategy against the fp64 references, on any world size.

Used by ``forge-dist demo`` and by the distributed tests: :func:`run_case` runs one op on this
rank's shard of a seeded global problem, forward and backward, gathers outputs, final states
and gradients, and compares them with the single-process fp64 recurrence.  Errors are relative
RMSE, ``||a - b|| / ||b||`` (docs/design.md section 9).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .variants import reference as ref
from .variants import registry

OPS = registry.names()  # every registered op (one registration adds it to the checks)
_FAMILIES = {"deltanet": "gated_delta_rule"}  # a named family checked by its base's reference
STRATEGIES = ("serial", "pipelined", "lasp2", "scan")


@dataclass
class CaseResult:
    """One op x strategy x world size x dtype x layout check (errors: relative RMSE)."""

    op: str
    strategy: str
    world_size: int
    dtype: str
    varlen: bool
    errors: Dict[str, float]
    seconds: float

    @property
    def max_error(self) -> float:
        return max(self.errors.values())

    def as_dict(self) -> dict:
        return asdict(self)


def tolerance(dtype: torch.dtype) -> float:
    """docs/design.md section 9: 1e-10 with fp64 inputs, 1e-4 with fp32 inputs."""
    return 1e-10 if dtype == torch.float64 else 1e-4


def _problem(op: str, T: int, T_local: int, dtype: torch.dtype, device, seed: int,
             varlen: bool, dims=(6, 5, 12)):
    """Seeded global inputs (fp64 masters) and the op's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    B = 1 if varlen else 2
    H = 2
    K, V, D = dims  # the defaults are small and ragged; kernels need K, V >= 16
    spec = registry.get(op)
    gate_shape = {"head": (B, T, H), "channel": (B, T, H, K), "feature": (B, T, D)}
    if spec.vector_state:
        tensors = {"x": randn(B, T, D)}
        state_shape = (D,)
    else:
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
        tensors = {"q": q, "k": k, "v": v}
        state_shape = (H, K, V)
    if spec.gate is not None:
        tensors["g"] = torch.nn.functional.logsigmoid(randn(*gate_shape[spec.gate]) + 2.0)
    if "beta" in spec.inputs:  # the delta rule: unit keys, write strengths in (0, 1)
        tensors["k"] = tensors["k"] / tensors["k"].norm(dim=-1, keepdim=True)
        tensors["beta"] = torch.sigmoid(randn(B, T, H))
    cu = None
    rows = B
    if varlen:
        # Boundaries that straddle shards, land on one, and leave one-token sequences.
        cuts = {0, T, max(1, T // 3 - 1), T // 2 + 1, T // 2 + 2, (3 * T) // 4 + 1}
        if T > T_local:
            cuts.add(T - T_local)
        cuts = sorted(cuts)
        cu = torch.tensor(cuts, dtype=torch.int64)
        rows = len(cuts) - 1
    tensors["initial_state"] = randn(rows, *state_shape)
    tensors = {k: v.to(dtype).to(device) for k, v in tensors.items()}
    return tensors, cu


def call_op(op: str, t: Dict[str, Tensor], **kw):
    """Run public op ``op`` on the named tensors of ``t`` (``initial_state`` optional)."""
    init = t.get("initial_state")
    args = [t[n] for n in registry.get(op).inputs]  # the public functions take them in order
    return getattr(ops, op)(*args, initial_state=init, **kw)


def call_reference(op: str, t: Dict[str, Tensor], **kw):
    """The fp64 recurrence of ``op`` on the named tensors of ``t``."""
    kw.setdefault("initial_state", t.get("initial_state"))
    base = _FAMILIES.get(op, op)
    # ``<op>_ref`` takes the op's inputs in its order; an absent optional one (g) is None
    args = [t.get(n) for n in registry.get(base).inputs]
    return getattr(ref, f"{base}_ref")(*args, **kw)


def rel_err(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64 (``||a - b||`` when ``b`` is zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def _gather_tokens(x: Tensor, group, world: int) -> Tensor:
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _sum_ranks(x: Tensor, group, world: int) -> Tensor:
    if world == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def run_case(op: str, strategy: str, dtype: torch.dtype, varlen: bool, *, group=None,
             T_local: int = 24, seed: int = 0, device="cpu", dims=(6, 5, 12)) -> CaseResult:
    """Run one check on every rank of ``group`` (collective); all ranks get the result.

    The fp64 reference runs once, on the group's rank 0, on the outputs, final state and
    gradients every rank has gathered (the same on each); the errors go to every rank."""
    if str(device) == "cuda":  # this process's current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    T = T_local * world
    t0 = time.perf_counter()
    full, cu = _problem(op, T, T_local, dtype, device, seed, varlen, dims)
    shard = slice(rank * T_local, (rank + 1) * T_local)
    mine = {k: (v[:, shard] if k != "initial_state" else v).clone().requires_grad_()
            for k, v in full.items()}
    o, final = call_op(op, mine, output_final_state=True, cu_seqlens=cu,
                        group=group if world > 1 else None, strategy=strategy)
    # Random linear functionals make every output element and every state entry matter.
    gen = torch.Generator().manual_seed(seed + 1)
    w_o = torch.randn(o.shape[:1] + (T,) + o.shape[2:], generator=gen,
                      dtype=torch.float64).to(device=device, dtype=o.dtype)
    w_s = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(device, final.dtype)
    owns_final = varlen or rank == world - 1
    loss = (o * w_o[:, shard]).sum() + ((final * w_s).sum() if owns_final else 0.0)
    loss.backward()

    # Every rank gathers the whole output, final state and gradients (collectives, the same
    # on every rank); rank 0 alone runs the reference and compares, and shares the errors.
    got = {"o": _gather_tokens(o.detach(), group, world)}
    final_all = final.detach() if not varlen else _sum_ranks(final.detach(), group, world)
    if varlen or world == 1:
        got["final_state"] = final_all
    else:  # the last rank holds the global final state
        last = final.detach().clone()
        if world > 1:
            dist.broadcast(last, src=dist.get_global_rank(group, world - 1), group=group)
        got["final_state"] = last
    for name, t in mine.items():
        if name == "initial_state":
            grad = t.grad if t.grad is not None else torch.zeros_like(t)
            got["d_initial_state"] = _sum_ranks(grad, group, world)
        else:
            got["d" + name] = _gather_tokens(t.grad, group, world)

    errors, failure = None, None
    if rank == 0:
        try:
            master = {k: v.detach().double().cpu().requires_grad_() for k, v in full.items()}
            o_ref, final_ref = call_reference(op, master, output_final_state=True,
                                              cu_seqlens=cu)
            ((o_ref * w_o.double().cpu()).sum()
             + (final_ref * w_s.double().cpu()).sum()).backward()
            want = {"o": o_ref, "final_state": final_ref}
            want.update({("d_initial_state" if k == "initial_state" else "d" + k): v.grad
                         for k, v in master.items()})
            errors = {k: rel_err(v, want[k]) for k, v in got.items()}
        except Exception as err:  # noqa: BLE001 - every rank raises it below, none waits
            failure = f"{type(err).__name__}: {err}"
    if world > 1:
        shared = [(errors, failure)]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        errors, failure = shared[0]
    if failure is not None:
        raise RuntimeError(f"selftest: the fp64 reference of {op} failed on rank 0: {failure}")
    return CaseResult(op, strategy, world, str(dtype).replace("torch.", ""), varlen, errors,
                      time.perf_counter() - t0)


def run_matrix(group=None, *, ops_: Optional[List[str]] = None,
               strategies: Optional[List[str]] = None,
               dtypes=(torch.float64, torch.float32), varlen=(False, True),
               progress: Optional[Callable[[CaseResult], None]] = None,
               device="cpu", T_local: int = 24, dims=(6, 5, 12)) -> List[CaseResult]:
    """Every op x strategy x dtype x layout on ``group`` (collective; same order on all ranks)."""
    results = []
    for op in ops_ or OPS:
        for strategy in strategies or STRATEGIES:
            for dtype in dtypes:
                for vl in varlen:
                    res = run_case(op, strategy, dtype, vl, group=group, device=device,
                                   T_local=T_local, dims=dims)
                    results.append(res)
                    if progress is not None:
                        progress(res)
    return results


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share_cores(world: int) -> None:
    """Give this process ``1 / world`` of the machine's cores for PyTorch's CPU threads, so
    that the ranks of a local world do not each run a full set of spinning OpenMP threads
    (on 2 cores a 4-rank gloo test ran 1.4x as long with the default); not where the user
    set ``OMP_NUM_THREADS``."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)  # the cores this process may run on
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // max(1, world))))


def init_local_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo world on loopback (used by spawned workers), sharing the machine's cores
    with the other ranks (:func:`share_cores`)."""
    share_cores(world)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def matrix_rows(group, **kwargs) -> List[dict]:
    """:func:`run_matrix` as plain dicts (what spawned workers hand back)."""
    return [r.as_dict() for r in run_matrix(group, **kwargs)]

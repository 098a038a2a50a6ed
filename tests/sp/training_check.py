"""What the sequence-parallel training tests share (tests/runtime/test_sp_train.py,
tests/ops/test_shard_call.py): one call's fp64 reference in one process, one rank's
training call and backward, and the errors of the rank's results against the reference."""
from __future__ import annotations

from typing import Dict, Optional

import torch


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def draws(step: int, B: int, T: int, H: int, K: int, V: int, vector_state: bool = False):
    """``(h0, do, dht)`` in fp64 for one step: the initial state, the output's weights in
    the loss and the weights of every rank's final state (``vector_state``: hgrn's, state
    ``[B, K]`` and output ``[B, T, K]``)."""
    gen = torch.Generator().manual_seed(9 + step)
    state, out = ((B, K), (B, T, K)) if vector_state else ((B, H, K, V), (B, T, H, V))
    return (torch.randn(*state, generator=gen, dtype=torch.float64),
            torch.randn(*out, generator=gen, dtype=torch.float64),
            torch.randn(*state, generator=gen, dtype=torch.float64))


def reference(op: str, full: Dict[str, Optional[torch.Tensor]], h0, do, dht, P: int,
              TL: int) -> dict:
    """The op on the whole sequence in fp64 (the PyTorch chunk form), with the loss every
    rank makes: ``<o, do>`` plus, per rank, ``<final state after the rank's shard, dht>``.
    Returns ``o``, ``finals`` (the state after each rank's shard), ``grads`` (by input
    name) and ``dh0``."""
    from forge_dist import ops

    fn = getattr(ops, op)
    leaves = {n: None if t is None else t.clone().requires_grad_(True) for n, t in full.items()}
    if h0 is not None:
        h0 = h0.clone().requires_grad_(True)
    o, _ = fn(*leaves.values(), initial_state=h0, output_final_state=True)
    loss, finals = (o * do).sum(), []
    for end in range(TL, P * TL + 1, TL) if dht is not None else ():
        prefix = [None if t is None else t[:, :end] for t in leaves.values()]
        final = fn(*prefix, initial_state=h0, output_final_state=True)[1]
        loss = loss + (final * dht).sum()
        finals.append(final.detach())
    loss.backward()
    return {"o": o.detach(), "finals": finals, "dh0": None if h0 is None else h0.grad,
            "grads": {n: None if t is None else t.grad for n, t in leaves.items()}}


def train_rank(op: str, x: Dict[str, Optional[torch.Tensor]], s0, do_mine, dht, group,
               strategy: str, twice: bool):
    """This rank's call with gradients and its backward (twice through the kept graph with
    ``twice``, the gradients then halved): ``(o, final state)``.  ``dht=None``: the call
    returns no final state (the usual training call)."""
    from forge_dist import ops

    o, ht = getattr(ops, op)(*x.values(), initial_state=s0,
                             output_final_state=dht is not None, group=group,
                             strategy=strategy)
    loss = (o.double() * do_mine).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht).sum()
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()
        for t in [*x.values(), s0]:
            if t is not None:
                t.grad /= 2
    return o, ht


def errors(ref: dict, rank: int, P: int, TL: int, o, ht, x, s0) -> list:
    """Relative errors of this rank's output, final state, input gradients and (rank 0)
    initial state gradient against :func:`reference`."""
    mine = slice(rank * TL, (rank + 1) * TL)
    errs = [rel(o, ref["o"][:, mine])]
    if ref["finals"]:
        errs.append(rel(ht, ref["finals"][rank]))
    errs += [rel(t.grad, ref["grads"][n][:, mine]) for n, t in x.items() if t is not None]
    if rank == 0 and s0 is not None:
        errs.append(rel(s0.grad, ref["dh0"]))
    return errs

"""Lowering onto the Triton templates of :mod:`forge_dist.kernels` (a real, narrow path).

What is lowered: matrix-state variants of kind identity / scalar / diagonal whose inputs are
named ``q, k, v`` (and ``g``: per-head ``[B, T, H]`` log decay for scalar, ``[B, T, H, K]`` for
diagonal) and whose phases are the decay-attention chunk form applied to *elementwise
prologues* of those inputs (feature maps, gate activations, scalings).  Steps:

1. prologue extraction (graph analysis): in ``merge_mode``, the maximal chain of elementwise
   ops (``relu``, ``elu``, ``sigmoid``, ``x + 1.0``, ...) hanging off each of ``q, k, v, g``;
2. template selection by the classified kind: identity -> ``linear_attn`` walker (no gate),
   scalar -> ``simple_gla`` (GATE=1), diagonal -> ``gla`` (GATE=2);
3. translation validation: on random fp64 probes the user's program must equal the template
   applied to the prologue outputs (outputs and final state, ragged length, nonzero initial
   state), for the user's ``scale`` or 1.  Anything else stays on the executor, with the reason
   in ``describe()``.

At run time on CUDA (or CPU tensors under ``TRITON_INTERPRET=1`` with
``FORGE_DIST_DSL_TRITON=1``) the prologue runs as PyTorch elementwise ops on the token tensors
and the fused walker does the rest; gradients flow through the prologue by autograd and through
the walker by the kernels' own autograd glue.  Not lowered: dense (delta-rule) transitions,
vector states, prologues that are not elementwise chains of one input (e.g. RetNet's
per-head constant decay) — those run on the executor.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..variants.transitions import Kind

_ELEMENTWISE_FUNCS = {torch.relu, torch.sigmoid, torch.exp, torch.tanh, torch.abs, torch.neg,
                      F.relu, F.elu, F.silu, F.softplus, F.logsigmoid, F.gelu, torch.sqrt,
                      torch.square}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "exp", "tanh", "abs", "neg", "sqrt", "square"}
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul,
          torch.sub}
_TEMPLATES = {Kind.IDENTITY: ("linear_attn", None), Kind.SCALAR: ("simple_gla", ""),
              Kind.DIAGONAL: ("gla", "K")}


def _elementwise_of(n: fx.Node, src: fx.Node) -> bool:
    """``n`` is an elementwise op whose only tensor operand is ``src``."""
    nodes = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: nodes.append(a))
    if nodes != [src]:
        return False
    if n.op == "call_function":
        if n.target in _ARITH:
            return all(isinstance(a, (int, float)) or a is src for a in n.args)
        return n.target in _ELEMENTWISE_FUNCS
    return n.op == "call_method" and n.target in _ELEMENTWISE_METHODS and len(n.args) == 1


def _chain(gm: fx.GraphModule, name: str) -> List[fx.Node]:
    node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name)
    chain = [node]
    while chain[-1].users:
        src = chain[-1]
        users = list(src.users)
        if not all(_elementwise_of(u, src) for u in users):
            break
        # phi(q) written twice is one prologue: all users must be the same op (validation
        # below checks the whole program anyway)
        sig = {(u.op, u.target, tuple(None if a is src else a for a in u.args),
                tuple(sorted(u.kwargs.items()))) for u in users}
        if len(sig) != 1:
            break
        chain.append(users[0])
    return chain


def _prologue(chain: List[fx.Node]) -> Tuple[Callable, str]:
    """A callable running the chain on any tensor (elementwise: layout does not matter)."""
    g = fx.Graph()
    env = {chain[0]: g.placeholder("x")}
    for n in chain[1:]:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[chain[-1]])
    gm = fx.GraphModule(torch.nn.Module(), g)
    text = " -> ".join([chain[0].target] + [n.name for n in chain[1:]])
    return gm, text


@dataclass
class Lowering:
    template: str  # kernels variant name
    prologues: Dict[str, Callable]  # input name -> elementwise map
    texts: Dict[str, str]
    scale_mode: str  # "user" (the call's scale) or "one"

    def summary(self) -> str:
        maps = [f"{k}: {t}" for k, t in self.texts.items() if "->" in t]
        return "prologue " + ("; ".join(maps) if maps else "none")

    def mapped(self, part: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: self.prologues[k](part[k]) for k in self.prologues}

    def make_work(self, part, scale: float, need_M: bool, *, out_dtype=None):
        from .. import kernels

        mapped = self.mapped(part)
        mapped = {k: (t if k == "g" else t.to(part["q"].dtype)) for k, t in mapped.items()}
        s = scale if self.scale_mode == "user" else 1.0
        return kernels.make_work(self.template, mapped, s, need_M, out_dtype=out_dtype)


def lower(v) -> Tuple[Optional[Lowering], str]:
    """``(Lowering, "")`` or ``(None, reason)`` for a compiled :class:`~.api.Variant`."""
    if v.vector:
        return None, "vector-state variants are not lowered yet (hgrn template unused)"
    if v.kind is Kind.DENSE:
        return None, "dense (delta-rule) transitions are not lowered yet"
    template, g_dims = _TEMPLATES[v.kind]
    want = {"q": "K", "k": "K", "v": "V"}
    if g_dims is not None:
        want["g"] = g_dims
    if v.inputs != want:
        return None, (f"the {template} template needs inputs exactly {want}, got {v.inputs}")
    prologues, texts = {}, {}
    for name in want:
        prologues[name], texts[name] = _prologue(_chain(v.merge.gm, name))
    for mode in ("user", "one"):
        low = Lowering(template, prologues, texts, mode)
        if _validate(v, low):
            return low, ""
    return None, ("merge_mode is not the template's chunk form on elementwise prologues of "
                  "q, k, v" + (", g" if g_dims is not None else "") +
                  " (translation validation failed)")


def _validate(v, low: Lowering) -> bool:
    """User program == template(prologues) on random fp64 probes.  The template side is the
    PyTorch chunk form the Triton template is tested against (and recomputes for backward)."""
    from ..variants import decay_attention

    gen = torch.Generator().manual_seed(4321)
    B, T, H, K, V = 1, 11, 2, 3, 4
    rnd = lambda *s: 0.5 * torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": rnd(B, T, H, K), "k": rnd(B, T, H, K), "v": rnd(B, T, H, V)}
    if "g" in v.inputs:
        x["g"] = F.logsigmoid(rnd(B, T, H, *((K,) if v.inputs["g"] == "K" else ())) + 2)
    S0 = rnd(B, H, K, V)
    try:
        with torch.no_grad():
            mine = v.summarize(x, 0.7, False, chunk_size=4)
            mapped = low.mapped(x)
            theirs = decay_attention.summarize(
                mapped["q"], mapped["k"], mapped["v"], mapped.get("g"),
                0.7 if low.scale_mode == "user" else 1.0, need_transition=False, chunk_size=4)
            a = mine.o_zero + mine.readout(S0)[0], mine.delta + mine.readout(S0)[1]
            b = theirs.o_zero + theirs.readout(S0)[0], theirs.delta + theirs.readout(S0)[1]
    except Exception:  # noqa: BLE001 - any failure means "not this template"
        return False
    return all(torch.allclose(p, q, rtol=1e-9, atol=1e-12) for p, q in zip(a, b))

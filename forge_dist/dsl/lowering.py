"""Lowering onto the Triton templates of :mod:`forge_dist.kernels` (a real, narrow path).

What is lowered: matrix-state variants of kind identity / scalar / diagonal whose inputs are
named ``q, k, v`` (and ``g``: per-head ``[B, T, H]`` log decay for scalar, ``[B, T, H, K]`` for
diagonal) and whose phases are the decay-attention chunk form applied to *elementwise
prologues* of those inputs (feature maps, gate activations, scalings).  Steps:

1. prologue extraction (graph analysis): in ``merge_mode``, the maximal chain of elementwise
   ops (``relu``, ``elu``, ``sigmoid``, ``x + 1.0``, ...) hanging off each of ``q, k, v, g``;
2. template selection by the classified kind: identity -> ``linear_attn`` walker (no gate),
   scalar -> ``simple_gla`` (GATE=1), diagonal -> ``gla`` (GATE=2), dense ->
   ``gated_delta_rule`` (WY kernel + walker; inputs ``q, k, v, beta`` and optionally ``g``),
   vector state -> ``hgrn`` (inputs ``x, g``);
3. translation validation: on random fp64 probes the user's program must equal the template
   applied to the prologue outputs (outputs and final state, ragged length, nonzero initial
   state), for the user's ``scale`` or 1.  Anything else stays on the executor, with the reason
   in ``describe()``.

At run time on CUDA (or CPU tensors under ``TRITON_INTERPRET=1`` with
``FORGE_DIST_DSL_TRITON=1``) each prologue chain of two or more ops the codegen translates
runs as one generated elementwise Triton kernel over the token tensor
(:mod:`forge_dist.kernels.prologue`: the chain written as a map of a tile, one read and one
write, and its generated derivative for the backward; a single op stays a PyTorch op, already
one pass), and the template's kernels do the rest, their Triton backward kernels included.  With ``fuse_prologues=True`` (``dsl.variant``) the map is instead applied to every
tile of that input the template's forward kernels load (no mapped copy is made; the backward
maps the inputs again in PyTorch and differentiates the prologue).  That is off by default:
on an H200 the walk, which is latency bound, lost more per chunk step than the pass it saves
(``scaling_benchmarks/results/dsl_prologue_*``).  Prologues the codegen has no translation
for run as PyTorch ops (``describe()`` says how each runs; the gated_delta_rule template
takes no fused maps).  Not lowered: prologues that are not
elementwise chains of one input (e.g. RetNet's per-head constant decay), programs that are
none of the five templates — those run on the executor.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..variants.transitions import Kind
from . import codegen
from .placement import use_kernels

_ELEMENTWISE_FUNCS = {torch.relu, torch.sigmoid, torch.exp, torch.tanh, torch.abs, torch.neg,
                      F.relu, F.elu, F.silu, F.softplus, F.logsigmoid, F.gelu, torch.sqrt,
                      torch.square}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "exp", "tanh", "abs", "neg", "sqrt", "square"}
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul,
          torch.sub}
_TEMPLATES = {Kind.IDENTITY: ("linear_attn", None), Kind.SCALAR: ("simple_gla", ""),
              Kind.DIAGONAL: ("gla", "K")}
_GATES = ("g", "beta")  # inputs passed to the kernels in their own dtype (fp32 gates)
# A prologue chain of at least this many ops runs as one generated elementwise kernel; a
# single op stays one PyTorch kernel, the same one pass with less launch overhead (H200,
# scaling_benchmarks/results/dsl_prologue_NVIDIA-H200_2026-11-25_s24.json: elu + 1, two
# PyTorch passes, at 64K tokens fwd 1.48 ms as a kernel vs 2.29, fwd+bwd 6.51 vs 7.30; relu
# and logsigmoid alone at 4K fwd 0.212 vs 0.168, equal from 16K).
PROLOGUE_KERNEL_MIN_OPS = 2


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


def _chain(gms: List[fx.GraphModule], name: str) -> List[fx.Node]:
    """The elementwise chain on input ``name`` in the first phase that reads it (merge_mode,
    then chunk_mode: the delta rule's merge reads v and beta only through cached WY
    factors); a lone placeholder (identity prologue) when no phase reads it."""
    node = next((n for gm in gms for n in gm.graph.nodes
                 if n.op == "placeholder" and n.target == name), None)
    if node is None:
        return [fx.Graph().placeholder(name)]
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


def _prologue(chain: List[fx.Node]) -> Tuple[Optional[Callable], str]:
    """A callable running the chain on any tensor (elementwise: layout does not matter), or
    ``None`` for the identity (no call at run time)."""
    if len(chain) == 1:
        return None, chain[0].target
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
    prologues: Dict[str, Optional[Callable]]  # input name -> elementwise map (None: identity)
    texts: Dict[str, str]
    scale_mode: str  # "user" (the call's scale) or "one"
    # input name -> InputMap: prologues the template's kernels apply as they load (codegen)
    fused: Dict[str, Any] = field(default_factory=dict)

    def how(self, name: str) -> str:
        """How input ``name``'s prologue runs: ``fused`` into the template's kernels, a
        generated ``Triton kernel`` before them (:mod:`forge_dist.kernels.prologue`), or
        ``PyTorch`` ops."""
        from ..kernels.prologue import ElementwisePrologue

        if name in self.fused:
            return "fused"
        if isinstance(self.prologues.get(name), ElementwisePrologue):
            return "Triton kernel"
        return "PyTorch"

    def summary(self) -> str:
        maps = [f"{k}: {t} ({self.how(k)})" for k, t in self.texts.items() if "->" in t]
        return "prologue " + ("; ".join(maps) if maps else "none")

    def mapped(self, part: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: part[k] if p is None else p(part[k]) for k, p in self.prologues.items()}

    def _template_inputs(self, part) -> Dict[str, torch.Tensor]:
        """What the template's kernels take: the prologue outputs, q/k/v (hgrn x) in the
        input dtype, gates as they come; inputs with a fused prologue as they are."""
        dtype = part["x" if self.template == "hgrn" else "q"].dtype
        out = {}
        for k, p in self.prologues.items():
            t = part[k] if p is None or k in self.fused else p(part[k])
            out[k] = t if k in _GATES else t.to(dtype)
        return out

    def make_work(self, part, scale: float, need_M: bool, *, out_dtype=None):
        from .. import kernels

        s = scale if self.scale_mode == "user" else 1.0
        return kernels.make_work(self.template, self._template_inputs(part), s, need_M,
                                 out_dtype=out_dtype, maps=self.fused)

    def planned_call(self, inputs, scale: float, initial_state, output_final_state):
        """The ops' short path (:mod:`forge_dist.ops.planned`: a cached plan, for a call on
        one GPU; with gradients for the hgrn template only) on the prologue outputs, or
        ``None`` when the call is not eligible.  ``initial_state`` and the returned state in
        the ops' layouts."""
        from ..ops import planned
        from ..ops.runner import needs_grad

        if (self.template != "hgrn" or self.fused) and needs_grad(inputs, initial_state):
            # matrix-state gradients, and hgrn's with a fused prologue (its planned backward
            # takes the mapped gates): the runner (skip the prologue here)
            return None
        x = self._template_inputs(inputs)
        maps = {n: m.kernel for n, m in self.fused.items()}
        common = dict(initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=None, group=None, use_kernels=True, maps=maps)
        if self.template == "hgrn":
            return planned.hgrn_call(x["x"], x["g"], **common)
        s = scale if self.scale_mode == "user" else 1.0
        return planned.matrix_call(self.template, x["q"], x["k"], x["v"],
                                   {"g": x.get("g"), "beta": x.get("beta")}, scale=s, **common)


def _template(v) -> Tuple[Optional[str], Dict[str, str], str]:
    """``(template, inputs it needs, "")`` for the variant's classified kind, or
    ``(None, {}, reason)``."""
    if v.vector:
        want = {"x": "D", "g": "D"}
        return ("hgrn", want, "") if v.inputs == want else (
            None, {}, f"the hgrn template needs inputs exactly {want}, got {v.inputs}")
    if v.kind is Kind.DENSE:
        want = {"q": "K", "k": "K", "v": "V", "beta": ""}
        if "g" in v.inputs:
            want = {"q": "K", "k": "K", "v": "V", "g": "", "beta": ""}
        if v.inputs != want:
            return None, {}, (f"the gated_delta_rule template needs inputs exactly {want} "
                              f"(g optional), got {v.inputs}")
        return "gated_delta_rule", want, ""
    template, g_dims = _TEMPLATES[v.kind]
    want = {"q": "K", "k": "K", "v": "V"}
    if g_dims is not None:
        want["g"] = g_dims
    if v.inputs != want:
        return None, {}, f"the {template} template needs inputs exactly {want}, got {v.inputs}"
    return template, want, ""


def lower(v, fuse: bool = False) -> Tuple[Optional[Lowering], str]:
    """``(Lowering, "")`` or ``(None, reason)`` for a compiled :class:`~.api.Variant`;
    ``fuse``: write the prologues the template can apply as Triton maps (:mod:`.codegen`)."""
    template, want, reason = _template(v)
    if template is None:
        return None, reason
    from ..kernels import MAPPABLE
    from ..kernels._common import InputMap
    from ..kernels.prologue import kernel_prologue

    prologues, texts, fused = {}, {}, {}
    for name in want:
        chain = _chain([v.merge.gm, v.chunk.gm], name)
        prologues[name], texts[name] = _prologue(chain)
        got = (codegen.triton_map(chain) if fuse and name in MAPPABLE.get(template, ())
               else None)
        if got is not None:
            fused[name] = InputMap(got[0], prologues[name])
        elif len(chain) - 1 >= PROLOGUE_KERNEL_MIN_OPS:  # one generated pass for the chain
            prologues[name] = kernel_prologue(codegen.triton_map(chain),
                                              codegen.triton_map_grad(chain),
                                              prologues[name], use_kernels) or prologues[name]
    for mode in ("user", "one"):
        low = Lowering(template, prologues, texts, mode, fused)
        if _validate(v, low):
            return low, ""
    return None, (f"merge_mode is not the {template} template's chunk form on elementwise "
                  f"prologues of {', '.join(want)} (translation validation failed)")


def _probes(v, gen) -> Dict[str, torch.Tensor]:
    """Random fp64 inputs for the variant's declared dims (gates as log decays, other
    per-head scalars in (0, 1) like beta)."""
    B, T, H, K, V, D = 1, 11, 2, 3, 4, 3
    sizes = {"K": K, "V": V, "D": D, "": None}
    lead = (B, T) if v.vector else (B, T, H)
    x = {}
    for name, dim in v.inputs.items():
        shape = lead + ((sizes[dim],) if dim else ())
        r = 0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)
        if name == "g":
            r = F.logsigmoid(r + 2)
        elif not dim:
            r = torch.sigmoid(r)
        x[name] = r
    return x


def _reference(template: str, mapped: Dict[str, torch.Tensor], scale: float):
    """The PyTorch chunk form each Triton template is tested against (and that the kernels'
    backward is checked with)."""
    from ..variants import decay_attention, delta_rule, vector_state

    if template == "hgrn":
        return vector_state.summarize(mapped["x"], mapped["g"], need_transition=False,
                                      chunk_size=4)
    if template == "gated_delta_rule":
        return delta_rule.summarize(mapped["q"], mapped["k"], mapped["v"], mapped.get("g"),
                                    mapped["beta"], scale, need_transition=False, chunk_size=4)
    return decay_attention.summarize(mapped["q"], mapped["k"], mapped["v"], mapped.get("g"),
                                     scale, need_transition=False, chunk_size=4)


def _validate(v, low: Lowering) -> bool:
    """User program == template(prologues) on random fp64 probes (outputs and final state,
    ragged length, nonzero initial state)."""
    gen = torch.Generator().manual_seed(4321)
    x = _probes(v, gen)
    first = x["x" if v.vector else "q"]
    S0 = 0.5 * torch.randn(*((first.shape[0], 1, first.shape[-1], 1) if v.vector else
                             (first.shape[0], first.shape[2], x["k"].shape[-1],
                              x["v"].shape[-1])), generator=gen, dtype=torch.float64)
    try:
        with torch.no_grad():
            mine = v.summarize(x, 0.7, False, chunk_size=4)
            theirs = _reference(low.template, low.mapped(x),
                                0.7 if low.scale_mode == "user" else 1.0)
            a = mine.o_zero + mine.readout(S0)[0], mine.delta + mine.readout(S0)[1]
            b = theirs.o_zero + theirs.readout(S0)[0], theirs.delta + theirs.readout(S0)[1]
    except Exception:  # noqa: BLE001 - any failure means "not this template"
        return False
    return all(torch.allclose(p, q, rtol=1e-9, atol=1e-12) for p, q in zip(a, b))

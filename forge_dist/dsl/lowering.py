"""Lowering onto the Triton templates of :mod:`forge_dist.kernels` (a real, narrow path).

What is lowered: variants whose phases are one of the five templates' chunk forms applied to
*prologues* of their inputs (feature maps, gate activations, scalings: elementwise, or a
softmax or a norm over each token's trailing dim, nothing that mixes tokens), whatever the
inputs are called.  Steps (the graphs are canonical already, :mod:`.canonical`):

1. template selection by state and classified kind: identity -> ``linear_attn`` walker,
   scalar -> ``simple_gla`` (GATE=1), diagonal -> ``gla`` (GATE=2), dense ->
   ``gated_delta_rule`` (WY kernel + walker; roles ``q, k, v, beta`` and optionally ``g``),
   vector state -> ``hgrn`` (roles ``x, g``);
2. role assignment (:mod:`.roles`): the user's inputs are matched to the template's roles by
   declared trailing dim and by which phases read them, never by name;
3. prologue extraction (graph analysis): in ``merge_mode`` (else ``chunk_mode``), the
   token-local DAG on each input up to the one node everything else the phase does with
   the input goes through (``relu(x) ** 2``, ``x * sigmoid(x)``, ``elu(x) + 1`` ...);
4. translation validation: on random fp64 probes the user's program must equal the template
   applied to the prologue outputs (outputs and final state, ragged length, nonzero initial
   state), for the user's ``scale`` or 1, for some role assignment (best fitting first).
   Anything else is not lowered, with the reason and a hint in ``describe()``.

At run time on CUDA (or CPU tensors under ``TRITON_INTERPRET=1`` with
``FORGE_DIST_DSL_TRITON=1``) each prologue of two or more ops the codegen translates
runs as one generated elementwise Triton kernel over the token tensor
(:mod:`forge_dist.kernels.prologue`: the DAG written as a map of a tile, one read and one
write, and its generated derivative for the backward; a single op stays a PyTorch op, already
one pass), and the template's kernels do the rest, their Triton backward kernels included.
With ``fuse_prologues=True`` (``dsl.variant``) the map is instead applied to every tile of
that input the template's forward kernels load (no mapped copy is made; the backward
maps the inputs again in PyTorch and differentiates the prologue).  That is off by default:
on an H200 the walk, which is latency bound, lost more per chunk step than the pass it saves
(``scaling_benchmarks/results/dsl_prologue_*``).  Prologues the codegen has no translation
for run as PyTorch ops (``describe()`` says how each runs; the gated_delta_rule template
takes no fused maps).  A role may be *shared*: where a variant has up to two more inputs of a
trailing dim than the template has roles of it, one role's prologue may read several of
them together (a decay summed from two gates, ``logsigmoid(a) + logsigmoid(b)``); a
per-head scalar may join a role of another trailing dim, broadcast over it
(``k * sigmoid(i)[..., None]``, an input gate); and where the maps on their own inputs fail
to validate, a role's map may also read other roles' inputs (RG-LRU's
``sqrt(1 - a^2) * sigmoid(i) * x`` reads the decay's ``r`` and ``lam``).  A map of several
inputs of one trailing dim runs as one generated kernel too (at most ``MAX_INPUTS``
inputs, never fused into the walks), also where per-head scalars join it through
``x[..., None]`` (each loaded once per element of the map's value); a prologue with a
reduction runs as PyTorch ops.
A ``merge_mode`` that returns a token-local map of the template's outputs and of inputs
has an *epilogue* (:class:`Epilogue`): an output gate ``o * sigmoid(z)``, Mamba2's skip term
``o + v * d[..., None]`` (its ``v`` the template's too), or both.  It lowers as the template
followed by that map, one generated elementwise kernel over ``o`` and the inputs (PyTorch
ops for a single op or a map the codegen does not translate), validated the same way.
Where none of that fits but the program's states, transitions and readout of the incoming
state are a matrix-state template's (its outputs inside a chunk differ: a strict mask, a
bonus for the current token), the template's kernels carry the state and a chunk-local
*residual* adds the difference (:class:`Residual`).  A scalar
decay no input carries (RetNet's per-head constant, computed from shapes) is read from the
program's own transition for each head count it is called with and checked there
(:class:`_ConstantDecay`).  Not lowered: programs that are none of the five templates up to
these: they take the generated path (:mod:`.generated`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import kernels
from ..kernels import MAPPABLE
from ..kernels.prologue import MAX_INPUTS, ElementwisePrologue, kernel_prologue
from ..kernels.work import InputMap
from ..ops import planned
from ..ops.runner import needs_grad
from ..variants import chunked as ck, decay_attention, delta_rule, vector_state
from ..variants.transitions import Kind
from . import codegen, executor, generated
from .placement import use_kernels
from .trace import DSLError
from .roles import (MAX_CANDIDATES, assignments, describe_roles, hint, is_delta_rule,
                    is_vector, names_of, reads, roles_of, template_for)

_ELEMENTWISE_FUNCS = {torch.relu, torch.sigmoid, torch.exp, torch.tanh, torch.abs, torch.neg,
                      operator.neg, F.relu, F.elu, F.silu, F.softplus, F.logsigmoid, F.gelu,
                      torch.sqrt, torch.square, torch.log, torch.rsqrt, torch.reciprocal,
                      torch.expm1, torch.log1p}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "exp", "tanh", "abs", "neg", "sqrt", "square",
                        "expm1", "log1p"}
# token-local reductions over the trailing dim (a softmax or a norm of one token's
# features): they never mix tokens, so they may end or sit inside a prologue, which then
# runs as PyTorch ops (the codegen writes elementwise maps only).  (A per-head scalar's
# trailing dim in the phases is the chunk's tokens: such a reduction there never validates.)
_TOKEN_LOCAL_FUNCS = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, F.normalize}
_TOKEN_LOCAL_METHODS = {"softmax", "log_softmax"}
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul,
          torch.sub, operator.gt, operator.ge, operator.lt, operator.le}
_GATES = ("g", "beta")  # roles passed to the kernels in their own dtype (fp32 gates)
# A prologue of at least this many ops runs as one generated elementwise kernel; a
# single op stays one PyTorch kernel, the same one pass with less launch overhead (H200,
# scaling_benchmarks/results/dsl_prologue_NVIDIA-H200_2026-11-25_s24.json: elu + 1, two
# PyTorch passes, at 64K tokens fwd 1.48 ms as a kernel vs 2.29, fwd+bwd 6.51 vs 7.30; relu
# and logsigmoid alone at 4K fwd 0.212 vs 0.168, equal from 16K).
PROLOGUE_KERNEL_MIN_OPS = 2


def _over_trailing_dim(n: fx.Node) -> bool:
    """``n`` is one of the token-local reductions (``_TOKEN_LOCAL_*``) over dim ``-1``, the
    trailing dim whatever the input's rank, with no ``out=``."""
    try:
        local = (n.op == "call_function" and n.target in _TOKEN_LOCAL_FUNCS) or (
            n.op == "call_method" and n.target in _TOKEN_LOCAL_METHODS)
    except TypeError:  # an unhashable target
        return False
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    return local and dim == -1 and n.kwargs.get("out") is None


def _is_token_local(n: fx.Node, inside: set) -> bool:
    """``n`` is a token-local op whose tensor operands are all in ``inside`` (and at least
    one is): an elementwise op, its other operands numbers, or a reduction over the
    trailing dim (:func:`_over_trailing_dim`)."""
    nodes = []
    fx.node.map_arg((n.args, n.kwargs), nodes.append)
    if not nodes or not all(a in inside for a in nodes):
        return False
    if _over_trailing_dim(n):
        return isinstance(n.args[0], fx.Node) and len(nodes) == 1
    numbers = all(isinstance(a, (fx.Node, int, float)) or a is None for a in n.args)
    if n.op == "call_function":
        if n.target in (torch.add, torch.sub):  # alpha= (the canonical form has none)
            return numbers and set(n.kwargs) <= {"alpha"} and len(n.args) == 2
        if n.target in _ARITH:
            return numbers and not n.kwargs and len(n.args) == 2
        if n.target is torch.where:
            return numbers and not n.kwargs and isinstance(n.args[0], fx.Node)
        if n.target is torch.clamp:
            return numbers and not n.kwargs
        if n.target is operator.getitem:  # x[..., None]: a per-head scalar broadcast over
            #                              the trailing dim of the role it joins
            return codegen.is_broadcast(n) and not n.kwargs
        try:
            return n.target in _ELEMENTWISE_FUNCS and isinstance(n.args[0], fx.Node)
        except TypeError:
            return False
    return n.op == "call_method" and n.target in _ELEMENTWISE_METHODS and len(n.args) == 1


def _ancestry(node: fx.Node, within: Optional[set] = None) -> set:
    """``node`` and every node it is computed from (only through ``within`` when given)."""
    found, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in found and (within is None or a in within):
                found.add(a)
                todo.append(a)
    return found


def _dag(gms: List[fx.GraphModule], names, borrow: Tuple[str, ...] = ()) -> List[fx.Node]:
    """The token-local DAG (:func:`_is_token_local`) on input ``names`` (one name, or the
    names a shared role reads together, :func:`.roles.names_of`) in the first phase that
    reads them all (merge_mode, then chunk_mode: the delta rule's merge reads v and beta
    only through cached WY factors): ``[placeholder, ..., node, ...]`` (the inputs'
    placeholders first, in ``names`` order, then those of ``borrow`` it reads) in graph
    order, ending with the prologue's value.

    The value is the latest node ``f`` of the inputs' token-local closure through which
    everything the phase does with them passes (every other node of ``f``'s ancestry that
    depends on one of them is used only inside it) and that depends on every one of them.
    ``borrow``: inputs of other roles the value may also read (RG-LRU's input scaling
    ``sqrt(1 - a^2)`` reads the decay's inputs); what the phase does with them elsewhere is
    their roles' business.  A lone placeholder (identity prologue) when there is none for a
    single input, or when no phase reads it; for several inputs without such a node, their
    placeholders (no prologue: the lowering fails to validate)."""
    names = names_of(names)
    found = None
    for gm in gms:
        ph = {n.target: n for n in gm.graph.nodes
              if n.op == "placeholder" and n.target in names + borrow and n.users}
        if all(n in ph for n in names):
            found = gm, [ph[n] for n in names], [ph[n] for n in borrow if n in ph]
            break
    if found is None:
        g = fx.Graph()
        return [g.placeholder(n) for n in names]
    gm, nodes, lent = found
    closure, order = set(nodes + lent), list(nodes + lent)
    own = set(nodes)  # nodes computed from the role's own inputs
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n not in closure \
                and _is_token_local(n, closure):
            closure.add(n)
            order.append(n)
            if any(a in own for a in n.all_input_nodes):
                own.add(n)
    for f in reversed(order):
        if f not in own:
            continue
        ancestry = _ancestry(f, closure)
        if len(nodes) > 1 and not all(p in ancestry for p in nodes):
            continue  # a shared role's value reads every one of its inputs
        if f.op == "call_function" and f.target is operator.getitem:
            continue  # x[..., None] only broadcasts inside a prologue, never ends one
        if all(set(a.users) <= ancestry for a in ancestry if a is not f and a in own):
            return [n for n in order if n in ancestry]
    return list(nodes)


class _ConstantDecay:
    """A scalar decay the program computes from shapes (RetNet's ``log(1 - 2^(-5 - h))``
    per head), not from an input: read from the program's own transition over a probe of
    ``T`` tokens (``g_h = log(M_h) / T``) for each head count it is called with, and checked
    there against the program (outputs and final state) before it is used."""

    T = 8

    def __init__(self, v, template: str, low: "Lowering"):
        self._v, self._template, self._low = v, template, low
        self._by_heads: Dict[int, torch.Tensor] = {}  # H -> fp64 [H] on the CPU
        self._placed: Dict[Tuple, torch.Tensor] = {}  # (H, device, dtype) -> [H] there

    def log_decay(self, H: int) -> torch.Tensor:
        got = self._by_heads.get(H)
        if got is None:
            got = self._by_heads[H] = self._read(H)
        return got

    def _read(self, H: int) -> torch.Tensor:
        probes = _probes(self._v, H=H)
        x = {k: t[:, :self.T] for k, t in probes.items() if k != "__S0"}
        with torch.no_grad():
            M = self._v.summarize(x, 0.7, True, chunk_size=4).transition
        if M is None or M.dim() != 2 or not bool((M > 0).all()):
            raise DSLError(f"{self._v.name}: the decay is not a positive per-head scalar")
        g = (M.log() / self.T)[0]  # [H]
        if not bool(torch.allclose(M.log() / self.T, g.expand_as(M), rtol=1e-9, atol=1e-12)):
            raise DSLError(f"{self._v.name}: the decay differs between batch rows")
        self._by_heads[H] = g
        if H != PROBE["H"] and not _matches(_run_user(self._v, probes), self._low, probes):
            del self._by_heads[H]
            raise DSLError(f"{self._v.name}: with {H} heads the program's decay is not a "
                           f"per-head constant the {self._template} template can take")
        return g

    def gates(self, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``g [B, T, H]`` for ``like [B, T, H, K]``: the constant log decay per head."""
        B, T, H = like.shape[:3]
        key = (H, like.device, dtype or like.dtype)
        g = self._placed.get(key)
        if g is None:  # (one copy to the device per head count, not one per call)
            g = self._placed[key] = self.log_decay(H).to(device=key[1], dtype=key[2])
        return g.expand(B, T, H).contiguous()


def _constant_candidates(v, template: str) -> List[Dict[str, object]]:
    """Role assignments of the scalar template with no input for its g (a decay the program
    computes itself, :class:`_ConstantDecay`); ``[]`` where that cannot be the form."""
    if is_vector(template) or "g" not in roles_of(template, v) or v.kind is not Kind.SCALAR:
        return []
    return assignments(template, v, without=("g",))[0]


def _first_match(v, template: str, candidates, mine, probes, fuse: bool, epilogue=None,
                 constant: bool = False, residual=None) -> Optional["Lowering"]:
    """The first role assignment of ``candidates`` (and scale mode) whose lowering equals
    the program on the probes, with its kernels; ``epilogue``: the map after the template
    (:class:`Epilogue`); ``constant``: the template's g read from the program (``None`` when the
    program's decay is not a per-head constant); ``residual``: the variant's chunk-local
    difference from the template, added to its outputs (:class:`Residual`)."""
    # the maps on each role's own inputs for every assignment first; then maps that may
    # borrow other roles' inputs (_dag)
    gms = [v.merge.gm, v.chunk.gm]
    own = [{r: _dag(gms, n) for r, n in roles.items()} for roles in candidates]
    for borrow in (False, True):
        for roles, own_dags in zip(candidates, own):
            dags = own_dags
            if borrow:
                dags = {r: _dag(gms, n, _others(v, n)) for r, n in roles.items()}
                if dags == own_dags:
                    continue  # no role borrows: validated in the first pass
            prologues, texts = {}, {}
            for r, dag in dags.items():
                prologues[r], texts[r] = _prologue(dag)
            reads_by_role = {r: tuple(p.target for p in dag[:codegen.inputs_of(dag)])
                             for r, dag in dags.items()}
            for mode in ("user", "one"):
                low = Lowering(template, roles, prologues, texts, mode, epilogue=epilogue,
                               reads=reads_by_role, residual=residual,
                               chunk_size=v.chunk_size)
                if constant:
                    low.constant_g = _ConstantDecay(v, template, low)
                    try:
                        low.constant_g.log_decay(PROBE["H"])
                    except DSLError:
                        return None
                if _matches(mine, low, probes):
                    return _with_kernels(low, dags, fuse, v.inputs)
    return None


def _others(v, names) -> Tuple[str, ...]:
    """The variant's inputs outside ``names`` (a role's), which its prologue may borrow."""
    mine = names_of(names)
    return tuple(n for n in v.input_names if n not in mine)


class _Without:
    """A variant seen without some of its inputs (an epilogue's own), for the role
    assignment."""

    def __init__(self, v, names: Tuple[str, ...]):
        self._v = v
        self.inputs = {n: d for n, d in v.inputs.items() if n not in names}
        self.input_names = [n for n in v.input_names if n not in names]

    def __getattr__(self, attr):
        return getattr(self._v, attr)


@dataclass
class Epilogue:
    """What ``merge_mode`` does to the template's outputs: ``out = fn(o, *inputs)``, a
    token-local map of the template's ``o`` and of the inputs ``reads`` (an output gate
    ``o * sigmoid(z)``, Mamba2's skip ``o + v * d[..., None]``, ...).

    ``only``: those of ``reads`` no other phase reads (no template role takes them).
    ``fn``: a generated elementwise kernel over ``o`` and the inputs (one read of each and
    one write, its derivative generated too; :class:`~forge_dist.kernels.prologue.ElementwisePrologue`),
    or PyTorch ops where the codegen has no translation or the map is a single op."""

    reads: Tuple[str, ...]
    only: Tuple[str, ...]
    fn: Callable
    text: str

    def apply(self, o: torch.Tensor, part: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The variant's outputs from the template's ``o [B, T, H, V]`` and this rank's
        inputs ``part`` (token tensors by name), in ``o``'s dtype."""
        xs = [part[n] for n in self.reads]
        if isinstance(self.fn, ElementwisePrologue):
            return self.fn(o, *xs, out_dtype=o.dtype)
        return self.fn(o, *xs).to(o.dtype)

    def how(self) -> str:
        return "Triton kernel" if isinstance(self.fn, ElementwisePrologue) else "PyTorch"


_O = "__o"  # the epilogue map's placeholder for the template's outputs


def _epilogue(v) -> Optional[Epilogue]:
    """The epilogue of ``merge_mode``, or ``None``: from its output, down through token-local
    ops (:func:`_is_token_local`) each with exactly one operand that is not a token-local
    function of the inputs alone, to the first node that is not such an op (the
    template's part, ``main``); the epilogue is the map of ``main`` and the inputs those
    ops read.  (A vector state's outputs ``[B, T, D]`` take it the same way.)"""
    gm = v.merge.gm
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node):
        return None
    local = {n for n in gm.graph.nodes if n.op == "placeholder" and n.target in v.inputs}
    for n in gm.graph.nodes:  # values computed token by token from the inputs alone
        if n.op in ("call_function", "call_method") and n not in local \
                and _is_token_local(n, local):
            local.add(n)
    main, body = out, []
    while main not in local:
        outside = [a for a in main.all_input_nodes if a not in local]
        if len(outside) != 1 or not _is_token_local(main, local | set(outside)) \
                or (body and set(main.users) != {body[-1]}):
            break
        body.append(main)
        main = outside[0]
    if not body or main in local:  # no map after the template's part, or no such part
        return None
    used = set(body)
    for n in body:
        for a in n.all_input_nodes:
            if a is not main:
                used |= _ancestry(a, local)
    nodes = [n for n in gm.graph.nodes if n in used]
    inputs = [n for n in nodes if n.op == "placeholder"]
    order = {name: i for i, name in enumerate(v.input_names)}
    inputs.sort(key=lambda p: order[p.target])
    where = reads(v)
    only = tuple(p.target for p in inputs
                 if where[p.target] == {"merge"} and set(p.users) <= used)
    g = fx.Graph()
    env = {main: g.placeholder(_O)}
    env.update((p, g.placeholder(p.target)) for p in inputs)
    for n in nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    chain = [n for n in g.nodes if n.op != "output"]
    fn = fx.GraphModule(torch.nn.Module(), g)
    names = ["o"] + [p.target for p in inputs]
    text = f"({', '.join(names)}) -> {{{', '.join(_op_text(n) for n in chain[len(names):])}}}"
    if len(chain) - len(names) >= PROLOGUE_KERNEL_MIN_OPS and \
            _runs_as_one_map(chain, {_O: "D" if v.vector else "V", **v.inputs}):
        fn = _as_kernel(chain, fn)
    return Epilogue(tuple(p.target for p in inputs), only, fn, text)


def _prologue(chain: List[fx.Node]) -> Tuple[Optional[Callable], str]:
    """A callable running the prologue DAG on its inputs' token tensors (the ops are
    elementwise or reduce the trailing dim, so any layout with the features last will do;
    a shared role's takes its inputs in order), or ``None`` for the identity (no call at
    run time)."""
    k = codegen.inputs_of(chain)
    if len(chain) == 1:
        return None, chain[0].target
    g = fx.Graph()
    env = {p: g.placeholder(f"x{i}") for i, p in enumerate(chain[:k])}
    for n in chain[k:]:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[chain[-1]])
    gm = fx.GraphModule(torch.nn.Module(), g)
    if k == 1:
        text = " -> ".join([chain[0].target] + [_op_text(n) for n in chain[1:]])
    else:  # a DAG of several inputs, not a chain
        text = (f"({', '.join(p.target for p in chain[:k])}) -> "
                f"{{{', '.join(_op_text(n) for n in chain[k:])}}}")
    return gm, text


def _op_text(n: fx.Node) -> str:
    if n.op == "call_method":
        return n.target
    return getattr(n.target, "__name__", n.name)


# templates with a matrix state: the residual form runs their chunk_mode (the delta rule's
# WY factors, which its merge_mode reads) and merge_mode at a zero state as graphs
RESIDUAL_TEMPLATES = ("linear_attn", "simple_gla", "gla", "gated_delta_rule")


class Residual:
    """What a variant adds to a template's outputs inside each chunk: on chunks of ``C``
    tokens from a zero chunk-start state, the variant's ``merge_mode`` on its inputs minus
    the template's on the prologue outputs (their offset parts,
    :func:`.analysis.offset_part`).  Where the variant's states, transitions and readout of
    the incoming state are the template's (the validation checks the whole sum), the
    variant's outputs are the template's plus this, for any chunking: so the template's
    kernels carry the state and only chunk-local work is left (a strict mask inside the
    chunk, a bonus for the current token).  It runs as PyTorch graphs, compiled by Inductor
    on CUDA where the generated path would be (:func:`.generated.unlowered_path`), compiled
    with dynamic shapes, so whole chunks and the ragged tail share it.  (Every residual
    shares :meth:`_chunks`'s code: past Dynamo's limit of compiled versions per function,
    8 by default, further variants, dtypes or scales run it eagerly.)"""

    def __init__(self, v, template: str):
        from .builtins import BUILTINS  # lazy: builtins compiles variants, which lower

        self.variant, self.template = v, BUILTINS[template]
        self._compiled = None

    @staticmethod
    def _offsets(v, part, C: int, dtype, scale: float):
        """``v``'s ``merge_mode`` at a zero chunk-start state on ``part``'s tokens (a whole
        number of chunks of ``C``), its chunk caches computed first where it reads them."""
        L = part[v.input_names[0]].shape[1]
        args = executor.chunk_inputs(v, part, 0, L, C, dtype)
        args["scale"] = scale
        if set(v.chunk.cached) & set(v.merge.params):
            out = executor.call(v.chunk.gm, v.chunk.params, args)
            args.update(zip(v.chunk.cached, out[1:]))
        args["state"] = None
        return executor.call(v.merge_offset, v.merge.params, args)

    def _chunks(self, part, mapped, C: int, scale: float, template_scale: float):
        """The difference on ``part``'s tokens, a whole number of chunks of ``C``:
        ``[B, H, NT, C, V]``."""
        dtype = ck.compute_dtype(part[self.variant.input_names[0]])
        return (self._offsets(self.variant, part, C, dtype, scale)
                - self._offsets(self.template, mapped, C, dtype, template_scale))

    def __call__(self, part: Dict[str, torch.Tensor], mapped: Dict[str, torch.Tensor],
                 scale: float, template_scale: float, C: int) -> torch.Tensor:
        """``[B, T, H, V]`` in the compute dtype: ``part`` the variant's token inputs by
        name, ``mapped`` the template's by role."""
        first = part[self.variant.input_names[0]]
        fn = self._chunks
        if first.is_cuda and generated.unlowered_path(first.device) == generated.GENERATED:
            if self._compiled is None:
                self._compiled = torch.compile(self._chunks, dynamic=True)
            fn = self._compiled
        out = []
        for lo, hi, Cp in executor.pieces(first.shape[1], C):
            cut = lambda ts: {n: t[:, lo:hi] for n, t in ts.items()}  # noqa: E731
            out.append(ck.from_chunks(fn(cut(part), cut(mapped), Cp, scale, template_scale),
                                      hi - lo))
        return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def _residual(v, template: str) -> Tuple[Optional[Residual], str]:
    """The residual form's parts, or ``None`` and why it cannot apply: a vector state, or
    a merge with no graph at a zero state."""
    if v.vector:
        return None, "a vector state"
    if template not in RESIDUAL_TEMPLATES:
        return None, f"the {template} template has no residual form"
    if v.merge_offset is None:
        return None, "merge_mode has no graph at a zero state"
    res = Residual(v, template)
    if res.template.merge_offset is None:
        return None, f"the {template} template has no graph at a zero state"
    return res, ""


@dataclass
class Lowering:
    template: str  # kernels variant name
    # template role (q, k, v, g, beta; hgrn x, g) -> the user's input (a tuple of inputs
    # for a shared role, whose prologue reads them together)
    roles: Dict[str, Any]
    prologues: Dict[str, Optional[Callable]]  # role -> token-local map (None: identity)
    texts: Dict[str, str]
    scale_mode: str  # "user" (the call's scale) or "one"
    # role -> InputMap: prologues the template's kernels apply as they load (codegen)
    fused: Dict[str, Any] = field(default_factory=dict)
    # a token-local map of the template's outputs and inputs after the template (an
    # output gate, an additive skip term)
    epilogue: Optional[Epilogue] = None
    # a decay no input carries: the program's per-head constant log decay, read from it for
    # each head count (:class:`_ConstantDecay`); the template's g role
    constant_g: Optional["_ConstantDecay"] = None
    # role -> the inputs its prologue reads, in order: the role's own, then any it borrows
    # from other roles (:func:`_dag`)
    reads: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    # the variant's outputs minus the template's inside each chunk, added to the template's
    # (:class:`Residual`; the variant's own chunk size)
    residual: Optional[Residual] = None
    chunk_size: int = 32

    def finish(self, o: torch.Tensor, part: Dict[str, torch.Tensor], scale: float,
               chunk_size: Optional[int] = None) -> torch.Tensor:
        """The variant's outputs from the template's ``o [B, T, H, V]`` on this rank's
        inputs ``part`` (``scale``: the call's): plus the residual, or the epilogue's map of
        them, where there is one (a lowering has at most one of the two)."""
        if self.residual is not None:
            r = self.residual(part, self.mapped(part), scale, self.template_scale(scale),
                              chunk_size or self.chunk_size)
            o = (o + r).to(o.dtype)
        return o if self.epilogue is None else self.epilogue.apply(o, part)

    @property
    def runs_after(self) -> bool:
        """Whether anything runs after the template (a residual, an epilogue)."""
        return self.residual is not None or self.epilogue is not None

    def template_scale(self, scale: float) -> float:
        """The scale the template runs with: the call's, or 1 (``scale_mode``)."""
        return scale if self.scale_mode == "user" else 1.0

    def reference_summary(self, part, scale: float, need_M: bool, chunk_size=None):
        """The template's PyTorch chunk form on the prologue outputs (what a part whose
        shapes the template's kernels do not cover runs), without what runs after it (the
        residual, the epilogue: :meth:`finish`)."""
        if chunk_size is None and is_delta_rule(self.template):
            chunk_size = 32  # (the delta rule's chunk form takes no default from None)
        return _reference(self.template, self.mapped(part), self.template_scale(scale), need_M,
                          chunk_size)

    def how(self, role: str) -> str:
        """How role ``role``'s prologue runs: ``fused`` into the template's kernels, a
        generated ``Triton kernel`` before them (:mod:`forge_dist.kernels.prologue`), or
        ``PyTorch`` ops."""
        if role in self.fused:
            return "fused"
        if isinstance(self.prologues.get(role), ElementwisePrologue):
            return "Triton kernel"
        return "PyTorch"

    def summary(self) -> str:
        maps = [f"{k}: {t} ({self.how(k)})" for k, t in self.texts.items() if "->" in t]
        renamed = describe_roles(self.roles)
        epi = ("" if self.epilogue is None else
               f"; epilogue: {self.epilogue.text} ({self.epilogue.how()})")
        if self.constant_g is not None:
            epi += "; g: the program's per-head constant log decay, read once per head count"
        if self.residual is not None:
            epi += ("; plus a chunk-local residual (the variant's outputs from a zero "
                    "chunk-start state minus the template's; PyTorch graphs, Inductor on CUDA)")
        return ((f"roles {renamed}; " if renamed else "") +
                "prologue " + ("; ".join(maps) if maps else "none") + epi)

    def _read(self, part, role: str) -> List[torch.Tensor]:
        return [part[n] for n in self.reads.get(role) or names_of(self.roles[role])]

    def mapped(self, part: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The template's inputs by role from the user's inputs by name (PyTorch maps)."""
        out = {r: self._read(part, r)[0] if p is None else p(*self._read(part, r))
               for r, p in self.prologues.items()}
        if self.constant_g is not None:
            out["g"] = self.constant_g.gates(out["q"])
        return out

    def _template_inputs(self, part) -> Dict[str, torch.Tensor]:
        """What the template's kernels take, by role: the prologue outputs, q/k/v (hgrn x)
        in the input dtype, gates as they come; inputs with a fused prologue as they are."""
        dtype = self._read(part, "x" if is_vector(self.template) else "q")[0].dtype
        out = {}
        for r, p in self.prologues.items():
            ts = self._read(part, r)
            if p is None or r in self.fused:
                t = ts[0]
            elif isinstance(p, ElementwisePrologue) and r not in _GATES:
                t = p(*ts, out_dtype=dtype)  # written once in the kernels' dtype
            else:
                t = p(*ts)
            out[r] = t if r in _GATES else t.to(dtype)
        if self.constant_g is not None:
            out["g"] = self.constant_g.gates(out["q"], torch.float32)
        return out

    def make_work(self, part, scale: float, need_M: bool, *, out_dtype=None):
        return kernels.make_work(self.template, self._template_inputs(part),
                                 self.template_scale(scale), need_M, out_dtype=out_dtype,
                                 maps=self.fused)

    def planned_call(self, inputs, scale: float, initial_state, output_final_state,
                     chunk_size: Optional[int] = None):
        """The ops' short path (:mod:`forge_dist.ops.planned`: a cached plan, for a call on
        one GPU; with gradients for the hgrn template only) on the prologue outputs, then
        :meth:`finish` (``chunk_size``: the call's, for a residual), or ``None`` when the
        call is not eligible.  ``initial_state`` and the returned state in the ops'
        layouts."""
        if (not is_vector(self.template) or self.fused) and needs_grad(inputs, initial_state):
            # matrix-state gradients, and hgrn's with a fused prologue (its planned backward
            # takes the mapped gates): the runner (skip the prologue here)
            return None
        x = self._template_inputs(inputs)
        maps = {n: m.kernel for n, m in self.fused.items()}
        common = dict(initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=None, group=None, use_kernels=True, maps=maps)
        if is_vector(self.template):
            got = planned.hgrn_call(x["x"], x["g"], **common)
        else:
            got = planned.matrix_call(self.template, x["q"], x["k"], x["v"],
                                      {"g": x.get("g"), "beta": x.get("beta")},
                                      scale=self.template_scale(scale), **common)
        if got is None:
            return None
        return self.finish(got[0], inputs, scale, chunk_size), got[1]


@dataclass
class Decision:
    """What :func:`lower` decided: the lowering, or why not and what would change it."""

    lowering: Optional[Lowering]
    reason: str = ""  # why no template fits ("" when lowered)
    hint: str = ""  # the change that would let it lower


def lower(v, fuse: bool = False) -> Decision:
    """Map a compiled :class:`~.api.Variant` onto its kind's template, its inputs matched
    to the template's roles (:mod:`.roles`); ``fuse``: write the prologues the template can
    apply as Triton maps (:mod:`.codegen`)."""
    template = template_for(v)
    epilogue = _epilogue(v)
    # (epilogue, role assignments, why none) in the order tried: the program as a template,
    # the program as a template followed by its epilogue (:class:`Epilogue`)
    forms = [(None, *_candidates(template, v))]
    if epilogue is not None:
        forms.append((epilogue, *_candidates(template, _Without(v, epilogue.only))))
    reason = forms[-1][2]  # (why the last form has no assignment, where none has one)
    if is_delta_rule(template) and "g" in roles_of(template, v):
        # two per-head scalars may also both feed beta, with no gate (a shared role)
        forms.insert(1, (None, *_candidates(template, v, without=("g",))))
    constant = _constant_candidates(v, template)
    tried = [c for _, c, _ in forms if c]
    if not tried and not constant:
        return Decision(None, reason, hint(v, template, reason))
    probes = _probes(v)
    mine = _run_user(v, probes)
    if mine is None:
        if tried:
            reason = "the variant gave non-finite values on the validation probes"
        return Decision(None, reason, hint(v, template, reason))
    for epi, candidates, _ in forms:
        low = _first_match(v, template, candidates, mine, probes, fuse, epilogue=epi)
        if low is not None:
            return Decision(low)
    low = _first_match(v, template, constant, mine, probes, fuse, constant=True)
    if low is not None:
        return Decision(low)
    residual, no_residual = _residual(v, template)
    if residual is not None and forms[0][1]:
        low = _first_match(v, template, forms[0][1], mine, probes, fuse, residual=residual)
        if low is not None:
            return Decision(low)
    if not tried:
        return Decision(None, reason, hint(v, template, reason))
    names = ", ".join(n for ns in tried[-1][0].values() for n in names_of(ns))
    reason = (f"the program is not the {template} template's chunk form on token-local "
              f"prologues of its inputs ({names}, in every role assignment their trailing "
              f"dims allow; translation validation failed)")
    if no_residual:  # nor its kernels plus a chunk-local residual
        reason += f"; no residual form: {no_residual}"
    return Decision(None, reason, hint(v, template, reason))


def _candidates(template: str, v, without: Tuple[str, ...] = ()):
    """:func:`.roles.assignments`, best first, without those whose shared roles' inputs never
    meet in one token-local value (their prologue cannot exist), then capped at
    :data:`.roles.MAX_CANDIDATES`: the cap never drops a viable assignment for hopeless
    ones.  ``without``: template roles no input fills (the delta rule's optional gate)."""
    got, reason = assignments(template, v, limit=None, without=without)
    gms = [v.merge.gm, v.chunk.gm]

    def viable(roles, borrow: bool):
        for ns in roles.values():
            names = names_of(ns)
            if len(names) > 1:
                dag = _dag(gms, names, _others(v, names) if borrow else ())
                if len(dag) == codegen.inputs_of(dag):  # the inputs never meet
                    return False
        return True
    # those viable on their own inputs before those viable only by borrowing (_dag)
    own = [a for a in got if viable(a, False)]
    lent = [a for a in got if a not in own and viable(a, True)]
    if got and not own + lent:
        reason = (f"the {template} template has fewer roles than the variant has inputs, and "
                  f"the inputs one role would have to read together never meet in one "
                  f"token-local expression")
    return (own + lent)[:MAX_CANDIDATES], reason


def _broadcast_is_flat(dag: List[fx.Node], dims: Dict[str, str]) -> bool:
    """Whether a map over inputs of several trailing dims runs as a flat kernel that loads
    each per-head scalar once per output element: its inputs are per-head scalars (``""``)
    and one feature dim, every scalar reaches the feature values only through
    ``x[..., None]`` (:func:`.codegen.is_broadcast`, the identity there), and its value
    has the feature dim."""
    k = codegen.inputs_of(dag)
    if len({dims.get(p.target) for p in dag[:k]} - {""}) != 1:
        return False
    wide = {p: dims.get(p.target) != "" for p in dag[:k]}  # node -> has the feature dim
    for n in dag[k:]:
        operands = [a for a in n.args if isinstance(a, fx.Node)]
        if codegen.is_broadcast(n):
            if wide[n.args[0]]:
                return False
            wide[n] = True
            continue
        kinds = {wide.get(a) for a in operands}
        if None in kinds or len(kinds) > 1:  # a scalar meets a feature value directly
            return False
        wide[n] = kinds.pop() if kinds else False
    return wide[dag[-1]]


def _runs_as_one_map(dag: List[fx.Node], dims: Dict[str, str]) -> bool:
    """Whether one generated map kernel takes the DAG's inputs: at most
    :data:`MAX_INPUTS`, and inputs of several trailing dims only as a flat broadcast
    (:func:`_broadcast_is_flat`)."""
    k = codegen.inputs_of(dag)
    broadcast = (len({dims.get(p.target) for p in dag[:k]}) > 1
                 or any(codegen.is_broadcast(n) for n in dag))
    return k <= MAX_INPUTS and (not broadcast or _broadcast_is_flat(dag, dims))


def _as_kernel(dag: List[fx.Node], fallback: Callable) -> Callable:
    """The DAG as one generated elementwise kernel with its generated gradient
    (:class:`ElementwisePrologue`, ``fallback`` where the kernels do not run), or
    ``fallback`` where the codegen has no translation."""
    return kernel_prologue(codegen.triton_map(dag), codegen.triton_map_grad(dag), fallback,
                           use_kernels) or fallback


def _with_kernels(low: Lowering, dags: Dict[str, List[fx.Node]], fuse: bool,
                  dims: Dict[str, str]) -> Lowering:
    """The validated lowering with its prologues as generated Triton: fused into the
    template's kernels (``fuse``, inputs it can map) or one elementwise kernel per role
    for prologues of at least :data:`PROLOGUE_KERNEL_MIN_OPS` ops (``dims``: the inputs'
    trailing dims; a map over per-head scalars and one feature dim runs as one kernel where
    :func:`_broadcast_is_flat`, others over several dims as PyTorch ops)."""
    for r, dag in dags.items():
        if not _runs_as_one_map(dag, dims):
            continue  # more inputs than one generated map takes, or a broadcast: PyTorch
        k = codegen.inputs_of(dag)
        # (a map of several inputs, a shared role's, is never fused into the walks)
        got = (codegen.triton_map(dag) if fuse and k == 1
               and r in MAPPABLE.get(low.template, ()) else None)
        if got is not None:
            low.fused[r] = InputMap(got[0], low.prologues[r])
        elif len(dag) - k >= PROLOGUE_KERNEL_MIN_OPS:  # one generated pass for the DAG
            low.prologues[r] = _as_kernel(dag, low.prologues[r])
    return low


PROBE = {"B": 1, "T": 11, "H": 2, "K": 3, "V": 4, "D": 3}


def _probes(v, H: int = PROBE["H"]) -> Dict[str, torch.Tensor]:
    """Random fp64 inputs for the variant's declared dims, the same whichever role an
    input takes: feature inputs ``0.5 N(0, 1)``, per-head scalars in (0, 1) (a beta, or a
    log decay's argument: the math is exact in fp64 either way); ``H`` heads."""
    gen = torch.Generator().manual_seed(4321)
    sizes = {"K": PROBE["K"], "V": PROBE["V"], "D": PROBE["D"]}
    lead = (PROBE["B"], PROBE["T"]) if v.vector else (PROBE["B"], PROBE["T"], H)
    x = {}
    for name, dim in v.inputs.items():
        r = 0.5 * torch.randn(*(lead + ((sizes[dim],) if dim else ())), generator=gen,
                              dtype=torch.float64)
        x[name] = r if dim else torch.sigmoid(r)
    x["__S0"] = 0.5 * torch.randn(*((PROBE["B"], 1, PROBE["D"], 1) if v.vector else
                                    (PROBE["B"], H, PROBE["K"], PROBE["V"])),
                                  generator=gen, dtype=torch.float64)
    return x


def _total(summary, S0):
    """``(outputs, final state)`` of a segment summary from the incoming state ``S0``."""
    o, end = summary.readout(S0)
    return summary.o_zero + o, summary.delta + end


def _run_user(v, probes):
    """The user's program on the probes (ragged chunks, nonzero initial state), or
    ``None`` when it is not finite."""
    x = {k: t for k, t in probes.items() if k != "__S0"}
    with torch.no_grad():
        got = _total(v.summarize(x, 0.7, False, chunk_size=4), probes["__S0"])
    return got if all(torch.isfinite(t).all() for t in got) else None


def _reference(template: str, mapped: Dict[str, torch.Tensor], scale: float,
               need: bool = False, chunk_size: Optional[int] = 4):
    """The PyTorch chunk form each Triton template is tested against (and that the kernels'
    backward is checked with); chunks of 4 for the validation probes."""
    if is_vector(template):
        return vector_state.summarize(mapped["x"], mapped["g"], need_transition=need,
                                      chunk_size=chunk_size)
    if is_delta_rule(template):
        return delta_rule.summarize(mapped["q"], mapped["k"], mapped["v"], mapped.get("g"),
                                    mapped["beta"], scale, need_transition=need,
                                    chunk_size=chunk_size)
    return decay_attention.summarize(mapped["q"], mapped["k"], mapped["v"], mapped.get("g"),
                                     scale, need_transition=need, chunk_size=chunk_size)


def _matches(mine, low: Lowering, probes) -> bool:
    """User program == template(prologues) on the fp64 probes (outputs and final state,
    ragged length, nonzero initial state)."""
    try:
        with torch.no_grad():
            theirs = _total(_reference(low.template, low.mapped(probes),
                                       low.template_scale(0.7)), probes["__S0"])
            theirs = (low.finish(theirs[0], probes, 0.7, chunk_size=4), theirs[1])
    except Exception:  # noqa: BLE001 - any failure means "not this template"
        return False
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-12)
               for a, b in zip(mine, theirs))

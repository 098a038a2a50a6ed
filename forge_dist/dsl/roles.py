"""Which Triton template a variant could be, and which of its inputs plays which role there.

Matching is by *role*, never by argument name: a template's roles (query, key, value, log
decay per head or per key channel, beta; hgrn's input and log decay) are told apart by the
input's declared trailing dim and by where the phases read it:

=======  ==============  ====================================================
role     trailing dim    read by
=======  ==============  ====================================================
q        K               merge_mode, not chunk_mode (outputs only)
k        K               chunk_mode (it builds the state)
v        V               -
g        "" / K / D      decay_mode (the transition)
beta     ""              chunk_mode, not decay_mode (the delta rule's step size)
x        D               chunk_mode, not decay_mode (hgrn's input)
=======  ==============  ====================================================

:func:`assignments` lists every role -> input assignment the dims allow, those that fit the
reads first; the lowering's translation validation (:mod:`.lowering`) then decides, so a
program that reads its inputs in unusual places still lowers when it is the template.
:func:`hint` says what would let a variant that fits no template lower.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Set, Tuple

from ..variants import registry
from ..variants.transitions import Kind

# a role's trailing dim: q/k/v/x by name, g by the registered gate's shape
_DIM_OF_INPUT = {"q": "K", "k": "K", "v": "V", "x": "D", "beta": ""}
_DIM_OF_GATE = {"head": "", "channel": "K", "feature": "D"}


def _roles(spec) -> Dict[str, str]:
    return {n: _DIM_OF_GATE[spec.gate] if n == "g" else _DIM_OF_INPUT[n] for n in spec.inputs}


# template (a registered variant with kernels) -> {role: trailing dim}; the delta rule's g is
# optional (:func:`roles_of`)
ROLES = {name: _roles(registry.get(name)) for name in registry.names()
         if registry.get(name).pattern is not None}
# a matrix state's transition kind -> its template (the first registered of that kind)
BY_KIND: Dict[Kind, str] = {}
for _name in ROLES:
    if not registry.get(_name).vector_state:
        BY_KIND.setdefault(registry.get(_name).kind, _name)
VECTOR_TEMPLATE = next(n for n in ROLES if registry.get(n).vector_state)
del _name
MAX_CANDIDATES = 12  # assignments validated at most (the delta rule with a gate and no
#                      extra inputs has 4; shared roles give more)


def is_vector(template: str) -> bool:
    """The template's state is a vector (hgrn: inputs ``x, g``, no q/k/v)."""
    return registry.get(template).vector_state


def is_delta_rule(template: str) -> bool:
    """The template is the delta rule (beta, and a gate that may be left out)."""
    return registry.get(template).pattern == "delta_rule"


def template_for(v) -> str:
    """The template of the variant's state and transition kind."""
    return VECTOR_TEMPLATE if v.vector else BY_KIND[v.kind]


def reads(v) -> Dict[str, Set[str]]:
    """Input name -> the phases (``chunk`` / ``decay`` / ``merge``) whose graphs use it."""
    out: Dict[str, Set[str]] = {n: set() for n in v.input_names}
    for tag, ph in (("chunk", v.chunk), ("decay", v.decay), ("merge", v.merge)):
        for n in ph.gm.graph.nodes:
            if n.op == "placeholder" and n.target in out and n.users:
                out[n.target].add(tag)
    return out


def roles_of(template: str, v) -> Dict[str, str]:
    """The template's roles for this variant (the delta rule's gate only when it has one
    more per-head scalar input than beta needs)."""
    roles = dict(ROLES[template])
    if is_delta_rule(template) and sum(1 for d in v.inputs.values() if d == "") < 2:
        del roles["g"]
    return roles


def _fit(role: str, phases: Set[str], name: str) -> float:
    """How well an input's reads fit a role (higher is better; the role's own name breaks
    ties, so conventional names are tried first)."""
    score = {"q": ("chunk" not in phases) + ("merge" in phases),
             "k": "chunk" in phases,
             "v": 0,
             "g": 2 * ("decay" in phases),
             "beta": "decay" not in phases,
             "x": "decay" not in phases}[role]
    return score + 0.5 * (name == role)


MAX_SHARED = 2  # inputs beyond the roles' count that may join another input's role


def names_of(assigned) -> Tuple[str, ...]:
    """The input names of a role's assignment: one name, or several (a shared role)."""
    return (assigned,) if isinstance(assigned, str) else tuple(assigned)


def _shared_assignments(roles: Dict[str, str], dims: Dict[str, str]):
    """Every way to give each role one or more inputs, all used, where each role gets at
    least one input of its own trailing dim (listed first) and an input of another dim is a
    per-head scalar (broadcast over the role's trailing dim, ``k * sigmoid(i)[..., None]``).
    A role with several inputs is *shared*: its prologue reads them together."""
    names = list(dims)
    options = [[r for r, rd in roles.items() if rd == dims[n] or dims[n] == ""]
                for n in names]
    for owner in itertools.product(*options):
        a: Dict[str, object] = {}
        for r, rd in roles.items():
            mine = [n for n, o in zip(names, owner) if o == r]
            own = [n for n in mine if dims[n] == rd]
            if not own:
                break
            mine = own + [n for n in mine if dims[n] != rd]  # its own dim's input first
            a[r] = mine[0] if len(mine) == 1 else tuple(mine)
        else:
            yield a


def assignments(template: str, v, limit: Optional[int] = MAX_CANDIDATES,
                without: Tuple[str, ...] = ()) -> Tuple[List[Dict[str, object]], str]:
    """``(candidates, "")``: role -> input assignments the declared dims allow, best fitting
    first (at most ``limit``); or ``([], reason)`` when the inputs cannot fill the roles.  A
    role takes one input name or, where the variant has up to :data:`MAX_SHARED` more inputs
    than the template has roles, a tuple of names its prologue reads together (inputs of
    its own trailing dim, and per-head scalars broadcast over it).  ``without``: roles no
    input fills (a decay the program computes as a per-head constant)."""
    roles = {r: d for r, d in roles_of(template, v).items() if r not in without}
    dims = v.inputs
    want = sorted(roles.values())
    have = sorted(dims.values())
    where = reads(v)
    if want == have:
        by_dim: Dict[str, List[str]] = {}
        for r, d in roles.items():
            by_dim.setdefault(d, []).append(r)
        choices = []
        for d, rs in by_dim.items():
            names = [n for n, nd in dims.items() if nd == d]
            choices.append([dict(zip(rs, perm)) for perm in itertools.permutations(names)])
        out = [{r: n for part in combo for r, n in part.items()}
               for combo in itertools.product(*choices)]
    elif 0 < len(dims) - len(roles) <= MAX_SHARED:
        out = list(_shared_assignments(roles, dims))
    else:
        out = []
    if not out:
        return [], (f"the {template} template takes inputs with trailing dims "
                    f"{_dims_text(roles)}; the variant has {_dims_text(dims)}")

    def fit(a):
        return sum(sum(_fit(r, where[n], n) for n in names_of(ns)) / len(names_of(ns))
                   for r, ns in a.items())
    out.sort(key=lambda a: -fit(a))
    return (out if limit is None else out[:limit]), ""


def _dims_text(dims: Dict[str, str]) -> str:
    return "{" + ", ".join(f"{n}: {d or 'per-head scalar'}" for n, d in dims.items()) + "}"


def hint(v, template: str, reason: str) -> str:
    """The change that would let the variant lower to ``template`` (for warnings)."""
    roles = roles_of(template, v)
    where = reads(v)
    decay_inputs = [n for n in v.input_names if "decay" in where[n]]
    n_extra = len(v.inputs) - len(roles)
    if not is_vector(template) and len(decay_inputs) > 1:
        return (f"more than one input feeds the decay ({', '.join(decay_inputs)}) and they "
                f"do not meet in one elementwise expression before the template's chunk form "
                f"(as logsigmoid(a) + logsigmoid(b) does): pass one log decay (for example "
                f"their sum) as a single input")
    if n_extra > 0:
        surplus = []
        for d in dict.fromkeys(v.inputs.values()):
            have = [n for n, nd in v.inputs.items() if nd == d]
            want = sum(1 for rd in roles.values() if rd == d)
            if len(have) > want:
                surplus.append(f"{', '.join(have)} have trailing dim {d or 'per-head scalar'} "
                               f"(the template takes {want})")
        return (f"the {template} template has roles {', '.join(roles)} only ("
                f"{'; '.join(surplus)}): apply the extra input outside the variant (gate the "
                f"output after the call) or fold it into another input before the call")
    if is_delta_rule(template) and n_extra < 0:
        return f"the {template} template needs a per-head beta input (the step size)"
    if "template takes inputs with trailing dims" in reason:
        if "g" in roles and roles["g"] not in v.inputs.values():
            return (f"pass the log decay as an input (trailing dims: "
                    f"{roles['g'] or 'per-head scalar'}) instead of computing it inside the "
                    f"phases, so that the {template} template has its g")
        return f"declare inputs with the template's trailing dims {_dims_text(roles)}"
    return ("write what each of the template's inputs gets as a function of each token's "
            "own inputs (feature maps, gate activations, scalings, a softmax or a norm over "
            "the trailing dim; nothing that mixes tokens) around the template's chunk form, "
            "and anything the template's outputs do not give (an added term) after the call")


def describe_roles(assignment: Dict[str, object]) -> Optional[str]:
    """``"g=gk, beta=b"`` for the renamed roles (a shared role ``g=(a, b)``), ``None`` when
    every name is the role's."""
    renamed = [f"{r}={n}" if isinstance(n, str) else f"{r}=({', '.join(n)})"
               for r, n in assignment.items() if r != n]
    return ", ".join(renamed) if renamed else None

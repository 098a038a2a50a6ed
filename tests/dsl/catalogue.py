"""A catalogue of variants as users write them, with the path each must take and its math.

Each :class:`Entry` holds the three phases (argument names as a user would pick them), the
path ``describe()`` must report (``template:<name>``, ``generated``, or ``refused`` for a
program that must not compile), and ``mapped``: the same inputs mapped beforehand onto the
nearest built-in op (its fp64 token recurrence in :mod:`forge_dist.variants.reference` is
the check; ``post`` finishes what the built-in does not do, such as an output gate).  The
benchmark ``scaling_benchmarks/dsl_variants.py`` times each variant against that built-in
on the mapped inputs.

Chunk tensors: ``[B, H, NT, C, D]`` (per-head scalars ``[B, H, NT, C]``), vector state
``[B, NT, C, D]``; token tensors ``[B, T, H, D]`` / ``[B, T, H]`` / ``[B, T, D]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from forge_dist import dsl
from forge_dist.dsl.helpers import segsum_exp, segsum_exp_vec
from forge_dist.variants import reference as ref

T = lambda x: x.transpose(-1, -2)  # noqa: E731


@dataclass
class Entry:
    name: str
    phases: Tuple[Callable, Callable, Callable]  # chunk_mode, decay_mode, merge_mode
    inputs: Dict[str, str]  # name -> trailing dim, in call order
    # "template:<name>", "residual:<name>" (the template's kernels plus a chunk-local
    # residual), "generated" or "refused"
    path: str
    builtin: str  # nearest built-in op (linear_attn, simple_gla, gla, gated_delta_rule, hgrn)
    mapped: Callable  # token inputs -> the built-in's inputs (q, k, v[, g][, beta] / x, g)
    post: Optional[Callable] = None  # (o, token inputs, scale) -> the variant's o
    prepare: Dict[str, Callable] = field(default_factory=dict)  # raw randn -> realistic input
    state: str = "matrix"
    # the variant's own fp64 token recurrence ``(x, h0, scale) -> (o, final state)`` where
    # no built-in and ``post`` give it (``mapped`` then only feeds the benchmark's built-in)
    ref: Optional[Callable] = None

    @functools.cached_property
    def variant(self) -> dsl.Variant:
        return self.compile(lower=True)

    @functools.cached_property
    def unlowered(self) -> dsl.Variant:
        """The variant without the lowering's search (the same program and fingerprint;
        CPU calls run the executor either way): cheaper to build in every rank."""
        return self.compile(lower=False)

    def compile(self, lower: bool) -> dsl.Variant:
        chunk, decay, merge = self.phases
        return dsl.variant(self.name, chunk_mode=chunk, decay_mode=decay, merge_mode=merge,
                           inputs=self.inputs, state=self.state, lower=lower,
                           chunk_size=16 if self.state == "vector" else None)

    def problem(self, T_: int, *, B: int = 1, H: int = 2, K: int = 6, V: int = 5, D: int = 7,
                seed: int = 0, dtype=torch.float64, device="cpu"):
        """Global token inputs by name (in call order) and an initial state."""
        gen = torch.Generator(device=device).manual_seed(seed)
        sizes = {"K": K, "V": V, "D": D}
        lead = (B, T_) if self.state == "vector" else (B, T_, H)
        x = {}
        for n, d in self.inputs.items():
            t = torch.randn(*lead, *((sizes[d],) if d else ()), generator=gen, device=device,
                            dtype=torch.float32 if dtype != torch.float64 else dtype)
            x[n] = self.prepare.get(n, lambda t: t)(t).to(dtype)
        shape = (B, D) if self.state == "vector" else (B, H, K, V)
        h0 = 0.5 * torch.randn(*shape, generator=gen, device=device,
                               dtype=torch.float32 if dtype != torch.float64 else dtype)
        return x, h0.to(dtype)

    def reference(self, x, h0, scale):
        """fp64 token recurrence of the built-in on the mapped inputs (then ``post``)."""
        if self.ref is not None:
            return self.ref(x, h0, scale)
        m = self.mapped(x)
        kw = dict(initial_state=h0, output_final_state=True)
        if self.builtin == "hgrn":
            o, s = ref.hgrn_ref(m["x"], m["g"], **kw)
        elif self.builtin == "gated_delta_rule":
            o, s = ref.gated_delta_rule_ref(m["q"], m["k"], m["v"], m.get("g"), m["beta"],
                                            scale=scale, **kw)
        elif self.builtin == "linear_attn":
            o, s = ref.linear_attn_ref(m["q"], m["k"], m["v"], scale=scale, **kw)
        else:
            o, s = getattr(ref, self.builtin + "_ref")(m["q"], m["k"], m["v"], m["g"],
                                                       scale=scale, **kw)
        return (o if self.post is None else self.post(o, x, scale)), s


unit = functools.partial(F.normalize, dim=-1)  # delta-rule keys (the data, not the program)


# -- linear attention with a feature map: phi written in different ways ---------------------
def feature_map_family(phi):
    """Linear attention on ``phi(q)``, ``phi(k)`` (identity transition)."""
    def chunk(k, v):
        return T(phi(k)) @ v

    def decay(state, chunk_state):
        return state + chunk_state

    def merge(state, q, k, v, scale):
        return scale * ((phi(q) @ T(phi(k))).tril() @ v + phi(q) @ state)
    return chunk, decay, merge


def _la_entry(name, phi, phi_ref, path="template:linear_attn"):
    return Entry(name, feature_map_family(phi), {"q": "K", "k": "K", "v": "V"}, path,
                 "linear_attn", lambda x: {"q": phi_ref(x["q"]), "k": phi_ref(x["k"]),
                                           "v": x["v"]})


def _relu2(x):
    return F.relu(x) ** 2


LA = [
    _la_entry("elu_plus_one", lambda x: F.elu(x) + 1.0, lambda x: F.elu(x) + 1.0),
    _la_entry("relu_pow2", lambda x: F.relu(x) ** 2, _relu2),
    _la_entry("relu_times_relu", lambda x: F.relu(x) * F.relu(x), _relu2),
    _la_entry("relu_square_method", lambda x: x.relu().square(), _relu2),
    _la_entry("clamp_cubed", lambda x: x.clamp(min=0) ** 3, lambda x: F.relu(x) ** 3),
    _la_entry("silu_by_hand", lambda x: x * torch.sigmoid(x), F.silu),
    _la_entry("leaky_relu_where", lambda x: torch.where(x > 0, x, 0.1 * x),
              lambda x: F.leaky_relu(x, 0.1)),
]


def _named_la_chunk(key, value):
    return T(key) @ value


def _named_la_decay(state, chunk_state):
    return state + chunk_state


def _named_la_merge(state, query, key, value, scale):
    return scale * ((query @ T(key)).tril() @ value + query @ state)


LA.append(Entry("renamed_linear_attn", (_named_la_chunk, _named_la_decay, _named_la_merge),
                {"query": "K", "key": "K", "value": "V"}, "template:linear_attn",
                "linear_attn", lambda x: {"q": x["query"], "k": x["key"], "v": x["value"]}))


# -- scalar (per-head) decay: gates with other names, extra gates, a second decay ------------
def _retention(q, k, v, G, state, scale):
    """Outputs of a chunk under per-head cumulative log decay ``G [..., C]``."""
    return scale * (((q @ T(k)) * segsum_exp(G)) @ v + (q * G.exp()[..., None]) @ state)


def _chunk_state(k, v, G):
    return T(k * (G[..., -1:] - G).exp()[..., None]) @ v


def _sg_a_chunk(k, v, a):
    return _chunk_state(k, v, F.logsigmoid(a).cumsum(-1))


def _sg_a_decay(state, chunk_state, a):
    return state * F.logsigmoid(a).sum(-1).exp()[..., None, None] + chunk_state


def _sg_a_merge(state, q, k, v, a, scale):
    return _retention(q, k, v, F.logsigmoid(a).cumsum(-1), state, scale)


def _relu_gla_chunk(k, v, g):
    return _chunk_state(F.relu(k) ** 2, v, g.cumsum(-1))


def _relu_gla_decay(state, chunk_state, g):
    return state * g.sum(-1).exp()[..., None, None] + chunk_state


def _relu_gla_merge(state, q, k, v, g, scale):
    return _retention(F.relu(q) ** 2, F.relu(k) ** 2, v, g.cumsum(-1), state, scale)


def _log_sig(t):
    return torch.log(torch.sigmoid(t))


def _logsig_chunk(k, v, forget):
    return _chunk_state(k, v, _log_sig(forget).cumsum(-1))


def _logsig_decay(state, chunk_state, forget):
    return state * _log_sig(forget).sum(-1).exp()[..., None, None] + chunk_state


def _logsig_merge(state, q, k, v, forget, scale):
    return _retention(q, k, v, _log_sig(forget).cumsum(-1), state, scale)


def _outgate_merge(state, q, k, v, a, z, scale):
    return _retention(q, k, v, F.logsigmoid(a).cumsum(-1), state, scale) * torch.sigmoid(z)


def _linear_outgate_merge(state, q, k, v, a, z, scale):
    return _retention(q, k, v, F.logsigmoid(a).cumsum(-1), state, scale) * z


def _d_skip_merge(state, q, k, v, a, d, scale):  # Mamba2's skip: y = SSD(x) + D x
    return _retention(q, k, v, F.logsigmoid(a).cumsum(-1), state, scale) + v * d[..., None]


def _strict_merge(state, q, k, v, a, scale):  # each token reads the state before its own key
    G = F.logsigmoid(a).cumsum(-1)
    return scale * (((q @ T(k)) * segsum_exp(G, strict=True)) @ v
                    + (q * G.exp()[..., None]) @ state)


def _ingate_chunk(k, v, a, i):
    return _chunk_state(k * torch.sigmoid(i)[..., None], v, F.logsigmoid(a).cumsum(-1))


def _ingate_merge(state, q, k, v, a, i, scale):
    return _retention(q, k * torch.sigmoid(i)[..., None], v, F.logsigmoid(a).cumsum(-1),
                      state, scale)


def _two_decay_chunk(k, v, a, b):
    return _chunk_state(k, v, (F.logsigmoid(a) + F.logsigmoid(b)).cumsum(-1))


def _two_decay_decay(state, chunk_state, a, b):
    return state * (F.logsigmoid(a) + F.logsigmoid(b)).sum(-1).exp()[..., None, None] \
        + chunk_state


def _two_decay_merge(state, q, k, v, a, b, scale):
    return _retention(q, k, v, (F.logsigmoid(a) + F.logsigmoid(b)).cumsum(-1), state, scale)


def _head_decay(x):
    """RetNet's fixed per-head log decay ``log(1 - 2^(-5-h))``, ``[B, H, NT, C]``."""
    h = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
    return torch.zeros_like(x[..., 0]) + torch.log(1 - 2.0 ** (-5.0 - h))[:, None, None]


def _ret_chunk(k, v):
    return _chunk_state(k, v, _head_decay(k).cumsum(-1))


def _ret_decay(state, chunk_state, k):
    return state * _head_decay(k).sum(-1).exp()[..., None, None] + chunk_state


def _ret_merge(state, q, k, v, scale):
    return _retention(q, k, v, _head_decay(k).cumsum(-1), state, scale)


def _retnet_g(x):
    B, T_, H = x["q"].shape[:3]
    h = torch.arange(H, dtype=x["q"].dtype, device=x["q"].device)
    return torch.log(1 - 2.0 ** (-5.0 - h)).expand(B, T_, H)


QKV = {"q": "K", "k": "K", "v": "V"}
SCALAR = [
    Entry("gate_named_a", (_sg_a_chunk, _sg_a_decay, _sg_a_merge), {**QKV, "a": ""},
          "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"])}),
    Entry("relu2_retention", (_relu_gla_chunk, _relu_gla_decay, _relu_gla_merge),
          {**QKV, "g": ""}, "template:simple_gla", "simple_gla",
          lambda x: {"q": _relu2(x["q"]), "k": _relu2(x["k"]), "v": x["v"], "g": x["g"]},
          prepare={"g": lambda t: F.logsigmoid(t + 2)}),
    Entry("log_of_sigmoid_forget", (_logsig_chunk, _logsig_decay, _logsig_merge),
          {**QKV, "forget": ""}, "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["forget"])}),
    Entry("output_gate", (_sg_a_chunk, _sg_a_decay, _outgate_merge), {**QKV, "a": "",
                                                                      "z": "V"},
          "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"])},
          post=lambda o, x, s: o * torch.sigmoid(x["z"])),
    Entry("output_gate_linear", (_sg_a_chunk, _sg_a_decay, _linear_outgate_merge),
          {**QKV, "a": "", "z": "V"}, "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"])},
          post=lambda o, x, s: o * x["z"]),
    # an additive term after the template's outputs (an epilogue that also reads v)
    Entry("mamba2_d_skip", (_sg_a_chunk, _sg_a_decay, _d_skip_merge), {**QKV, "a": "", "d": ""},
          "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"])},
          post=lambda o, x, s: o + x["v"] * x["d"][..., None]),
    # a strictly causal readout (token t reads the state before its own key, decayed to t):
    # inside the intra-chunk product, so no template and no epilogue fits; the template's
    # kernels carry the state and a chunk-local residual the difference
    Entry("strict_readout", (_sg_a_chunk, _sg_a_decay, _strict_merge), {**QKV, "a": ""},
          "residual:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"])},
          post=lambda o, x, s: o - s * (x["q"] * x["k"]).sum(-1, keepdim=True) * x["v"]),
    Entry("input_gate", (_ingate_chunk, _sg_a_decay, _ingate_merge), {**QKV, "a": "", "i": ""},
          "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"] * torch.sigmoid(x["i"])[..., None], "v": x["v"],
                     "g": F.logsigmoid(x["a"])}),
    Entry("second_decay", (_two_decay_chunk, _two_decay_decay, _two_decay_merge),
          {**QKV, "a": "", "b": ""}, "template:simple_gla", "simple_gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"],
                     "g": F.logsigmoid(x["a"]) + F.logsigmoid(x["b"])}),
    Entry("retnet_head_decay", (_ret_chunk, _ret_decay, _ret_merge), dict(QKV),
          "template:simple_gla", "simple_gla", lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": _retnet_g(x)}),
]


# -- per-channel (diagonal) decay ------------------------------------------------------------
def _vec_chunk_state(k, v, G):
    return T(k * (G[..., -1:, :] - G).exp()) @ v


def _vec_outputs(q, k, v, G, state, scale):
    A = (q[..., :, None, :] * k[..., None, :, :] * segsum_exp_vec(G)).sum(-1)
    return scale * (A @ v + (q * G.exp()) @ state)


def _gk(gk):
    return F.logsigmoid(gk) / 16.0


def _gla_chunk(k, v, gk):
    return _vec_chunk_state(k, v, _gk(gk).cumsum(-2))


def _gla_decay(state, chunk_state, gk):
    return state * _gk(gk).sum(-2).exp()[..., None] + chunk_state


def _gla_merge(state, q, k, v, gk, scale):
    return _vec_outputs(q, k, v, _gk(gk).cumsum(-2), state, scale)


def _alpha_chunk(k, v, alpha):
    return _vec_chunk_state(k, v, alpha.cumsum(-2))


def _alpha_decay(state, chunk_state, alpha):
    return state * alpha.sum(-2).exp()[..., None] + chunk_state


def _alpha_merge(state, q, k, v, alpha, scale):
    return _vec_outputs(F.silu(q), k, v, alpha.cumsum(-2), state, scale)


def _gla_outgate_merge(state, q, k, v, gk, z, scale):
    return _vec_outputs(q, k, v, _gk(gk).cumsum(-2), state, scale) * F.silu(z)


DIAGONAL = [
    Entry("gla_gate_gk", (_gla_chunk, _gla_decay, _gla_merge), {**QKV, "gk": "K"},
          "template:gla", "gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": _gk(x["gk"])}),
    Entry("gla_alpha_silu_q", (_alpha_chunk, _alpha_decay, _alpha_merge),
          {**QKV, "alpha": "K"}, "template:gla", "gla",
          lambda x: {"q": F.silu(x["q"]), "k": x["k"], "v": x["v"], "g": x["alpha"]},
          prepare={"alpha": lambda t: F.logsigmoid(t + 3)}),
    Entry("gla_output_gate", (_gla_chunk, _gla_decay, _gla_outgate_merge),
          {**QKV, "gk": "K", "z": "V"}, "template:gla", "gla",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": _gk(x["gk"])},
          post=lambda o, x, s: o * F.silu(x["z"])),
]


# -- delta rule -------------------------------------------------------------------------------
def _wy(k, v, G, beta):
    """The WY factors of a chunk: ``(u, w, kt)`` (see forge_dist.dsl.builtins)."""
    C = k.shape[-2]
    eye = k.new_ones(C).diag()
    system = eye + beta[..., None] * (k @ T(k)) * segsum_exp(G, strict=True)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False,  # noqa: E731
                                                      unitriangular=True)
    return (solve(beta[..., None] * v), solve((beta * G.exp())[..., None] * k),
            k * (G[..., -1:] - G).exp()[..., None])


def _gdn_chunk(k, v, a, b):
    u, w, kt = _wy(k, v, F.logsigmoid(a).cumsum(-1), torch.sigmoid(b))
    dsl.cache("u", u)
    dsl.cache("w", w)
    return T(dsl.cache("kt", kt)) @ u


def _gdn_decay(state, chunk_state, a, kt, w):
    return state * F.logsigmoid(a).sum(-1).exp()[..., None, None] - T(kt) @ (w @ state) \
        + chunk_state


def _gdn_out(state, q, k, G, u, w, scale):
    A = (q @ T(k)) * segsum_exp(G)
    return scale * (A @ (u - w @ state) + (q * G.exp()[..., None]) @ state)


def _gdn_merge(state, q, k, a, u, w, scale):
    return _gdn_out(state, q, k, F.logsigmoid(a).cumsum(-1), u, w, scale)


def _gdn_bonus_merge(state, q, k, v, a, u, w, scale):  # plus a bonus for the current token
    return _gdn_merge(state, q, k, a, u, w, scale) + \
        scale * (q * k).sum(-1, keepdim=True) * v


def _gdn_strict_merge(state, q, k, a, u, w, scale):  # before each token's own update
    G = F.logsigmoid(a).cumsum(-1)
    A = (q @ T(k)) * segsum_exp(G, strict=True)
    return scale * (A @ (u - w @ state) + (q * G.exp()[..., None]) @ state)


def _gdn_strict_ref(x, h0, scale):
    """fp64 token recurrence: ``S <- a_t S``; ``o_t = scale q_t^T S``; then the delta
    update ``S <- S + beta_t k_t (v_t - S^T k_t)^T``."""
    q, k, v = (x[n].double() for n in "qkv")
    a, beta = torch.sigmoid(x["a"].double()), torch.sigmoid(x["b"].double())
    S = h0.double().clone()
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        S = S * a[:, t, :, None, None]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * err[:, :, None, :]
    return o, S


def _gdn_outgate_merge(state, q, k, a, z, u, w, scale):
    return _gdn_out(state, q, k, F.logsigmoid(a).cumsum(-1), u, w, scale) * torch.sigmoid(z)


def _delta_chunk(k, v, lr):
    G = torch.zeros_like(lr)
    u, w, kt = _wy(k, v, G, lr)
    dsl.cache("u", u)
    dsl.cache("w", w)
    return T(k) @ u


def _delta_two_rates_chunk(k, v, a, b):  # a step size from two per-head gates, no decay
    return _delta_chunk(k, v, torch.sigmoid(a) * torch.sigmoid(b))


def _delta_decay(state, chunk_state, k, w):
    return state - T(k) @ (w @ state) + chunk_state


def _delta_merge(state, q, k, u, w, scale):
    return scale * ((q @ T(k)).tril() @ (u - w @ state) + q @ state)


DELTA = [
    Entry("gated_delta_a_b", (_gdn_chunk, _gdn_decay, _gdn_merge),
          {**QKV, "a": "", "b": ""}, "template:gated_delta_rule", "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"]),
                     "beta": torch.sigmoid(x["b"])}, prepare={"k": unit}),
    Entry("deltanet_lr", (_delta_chunk, _delta_decay, _delta_merge), {**QKV, "lr": ""},
          "template:gated_delta_rule", "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "beta": x["lr"]},
          prepare={"k": unit, "lr": torch.sigmoid}),
    Entry("deltanet_two_rates", (_delta_two_rates_chunk, _delta_decay, _delta_merge),
          {**QKV, "a": "", "b": ""}, "template:gated_delta_rule", "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"],
                     "beta": torch.sigmoid(x["a"]) * torch.sigmoid(x["b"])},
          prepare={"k": unit}),
    Entry("gated_delta_output_gate", (_gdn_chunk, _gdn_decay, _gdn_outgate_merge),
          {**QKV, "a": "", "b": "", "z": "V"}, "template:gated_delta_rule",
          "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"]),
                     "beta": torch.sigmoid(x["b"])},
          post=lambda o, x, s: o * torch.sigmoid(x["z"]), prepare={"k": unit}),
    # a bonus for the current token (as RWKV's): inside the chunk, not token-local in the
    # lowering's sense (a sum over the features), so a chunk-local residual on the template
    Entry("gated_delta_bonus", (_gdn_chunk, _gdn_decay, _gdn_bonus_merge),
          {**QKV, "a": "", "b": ""}, "residual:gated_delta_rule", "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"]),
                     "beta": torch.sigmoid(x["b"])}, prepare={"k": unit},
          post=lambda o, x, s: o + s * (x["q"] * x["k"]).sum(-1, keepdim=True) * x["v"]),
    # the delta rule read before each token's own update: the difference from the template
    # depends on the state (the diagonal of the intra-chunk product meets the state's
    # correction of each value), so no residual form either; the generated path
    Entry("gated_delta_strict_readout", (_gdn_chunk, _gdn_decay, _gdn_strict_merge),
          {**QKV, "a": "", "b": ""}, "generated", "gated_delta_rule",
          lambda x: {"q": x["q"], "k": x["k"], "v": x["v"], "g": F.logsigmoid(x["a"]),
                     "beta": torch.sigmoid(x["b"])}, prepare={"k": unit},
          ref=_gdn_strict_ref),
]


# -- vector state (hgrn / RG-LRU) -------------------------------------------------------------
def _hgrn_chunk(u, f):
    h = dsl.cache("h", (segsum_exp_vec(F.logsigmoid(f).cumsum(-2)) * u[..., None, :, :]).sum(-2))
    return h[..., -1, :]


def _hgrn_decay(state, chunk_state, f):
    return state * F.logsigmoid(f).sum(-2).exp() + chunk_state


def _hgrn_merge(state, h, f):
    return h + F.logsigmoid(f).cumsum(-2).exp() * state[..., None, :]


def _hgrn_outgate_merge(state, h, f, z):  # HGRN with its output gated by a third input
    return _hgrn_merge(state, h, f) * torch.sigmoid(z)


def _lru_gates(x, r, i, lam):
    log_a = -8.0 * F.softplus(-lam) * torch.sigmoid(r)
    return log_a, torch.sqrt(-torch.expm1(2.0 * log_a)) * (torch.sigmoid(i) * x)


def _lru_chunk(x, r, i, lam):
    log_a, u = _lru_gates(x, r, i, lam)
    h = dsl.cache("h", (segsum_exp_vec(log_a.cumsum(-2)) * u[..., None, :, :]).sum(-2))
    return h[..., -1, :]


def _lru_decay(state, chunk_state, r, lam):
    return state * (-8.0 * F.softplus(-lam) * torch.sigmoid(r)).sum(-2).exp() + chunk_state


def _lru_merge(state, h, r, lam):
    return h + (-8.0 * F.softplus(-lam) * torch.sigmoid(r)).cumsum(-2).exp() * state[..., None, :]


def _lru_mapped(x):
    log_a, u = _lru_gates(x["x"], x["r"], x["i"], x["lam"])
    return {"x": u, "g": log_a}


# forget gates normalised over the channels: a decay that is no elementwise map of an input
def _norm_chunk(u, f):
    h = dsl.cache("h", (segsum_exp_vec(F.log_softmax(f, -1).cumsum(-2))
                        * u[..., None, :, :]).sum(-2))
    return h[..., -1, :]


def _norm_decay(state, chunk_state, f):
    return state * F.log_softmax(f, -1).sum(-2).exp() + chunk_state


def _norm_merge(state, h, f):
    return h + F.log_softmax(f, -1).cumsum(-2).exp() * state[..., None, :]


VECTOR = [
    Entry("hgrn_u_f", (_hgrn_chunk, _hgrn_decay, _hgrn_merge), {"u": "D", "f": "D"},
          "template:hgrn", "hgrn", lambda x: {"x": x["u"], "g": F.logsigmoid(x["f"])},
          state="vector"),
    Entry("hgrn_output_gate", (_hgrn_chunk, _hgrn_decay, _hgrn_outgate_merge),
          {"u": "D", "f": "D", "z": "D"}, "template:hgrn", "hgrn",
          lambda x: {"x": x["u"], "g": F.logsigmoid(x["f"])},
          post=lambda o, x, s: o * torch.sigmoid(x["z"]), state="vector"),
    Entry("rg_lru", (_lru_chunk, _lru_decay, _lru_merge),
          {"x": "D", "r": "D", "i": "D", "lam": "D"}, "template:hgrn", "hgrn", _lru_mapped,
          state="vector"),
    Entry("hgrn_softmax_gate", (_norm_chunk, _norm_decay, _norm_merge), {"u": "D", "f": "D"},
          "template:hgrn", "hgrn", lambda x: {"x": x["u"], "g": F.log_softmax(x["f"], -1)},
          state="vector"),
]


# -- refused: the update is not affine in the state -------------------------------------------
def _tanh_decay(state, chunk_state):
    return torch.tanh(state) + chunk_state


REFUSED = [Entry("tanh_state_update", (feature_map_family(F.relu)[0], _tanh_decay,
                                       feature_map_family(F.relu)[2]),
                 dict(QKV), "refused", "linear_attn", lambda x: x)]

CATALOGUE: Dict[str, Entry] = {e.name: e for e in LA + SCALAR + DIAGONAL + DELTA + VECTOR +
                               REFUSED}
RUNNABLE = [n for n, e in CATALOGUE.items() if e.path != "refused"]

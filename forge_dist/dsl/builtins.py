"""The five built-in ops written in the DSL (each the same math as ``forge_dist.ops.*``).

Chunk tensors: ``q, k [B, H, NT, C, K]``, ``v [B, H, NT, C, V]``, ``g, beta [B, H, NT, C]``
(gla: ``g [B, H, NT, C, K]``); hgrn: ``x, g [B, NT, C, D]``.  ``G`` is the in-chunk cumulative
log decay; every exponent is a masked difference (see :mod:`.helpers`).
"""
import torch

from .api import variant
from .helpers import eye_like, segsum_exp, segsum_exp_vec
from .trace import cache

T = lambda x: x.transpose(-1, -2)  # noqa: E731


# linear_attn: S' = S + sum_j k_j v_j^T -------------------------------------------------------
def _la_chunk(k, v):
    return T(k) @ v


def _la_decay(state, chunk_state):
    return state + chunk_state


def _la_merge(state, q, k, v, scale):
    return scale * ((q @ T(k)).tril() @ v + q @ state)


linear_attn = variant("linear_attn", chunk_mode=_la_chunk, decay_mode=_la_decay,
                      merge_mode=_la_merge, inputs=("q", "k", "v"), chunk_size=64)


# simple_gla: scalar decay per head and token ---------------------------------------------
def _sg_chunk(k, v, g):
    G = g.cumsum(-1)
    return T(k * (G[..., -1:] - G).exp()[..., None]) @ v


def _sg_decay(state, chunk_state, g):
    return state * g.sum(-1).exp()[..., None, None] + chunk_state


def _sg_merge(state, q, k, v, g, scale):
    G = g.cumsum(-1)
    return scale * (((q @ T(k)) * segsum_exp(G)) @ v + (q * G.exp()[..., None]) @ state)


simple_gla = variant("simple_gla", chunk_mode=_sg_chunk, decay_mode=_sg_decay,
                     merge_mode=_sg_merge, inputs=("q", "k", "v", "g"), chunk_size=64)


# gla: a decay per key dimension (diagonal transition) -------------------------------------
def _gla_chunk(k, v, g):
    G = g.cumsum(-2)
    return T(k * (G[..., -1:, :] - G).exp()) @ v


def _gla_decay(state, chunk_state, g):
    return state * g.sum(-2).exp()[..., None] + chunk_state


def _gla_merge(state, q, k, v, g, scale):
    G = g.cumsum(-2)
    A = (q[..., :, None, :] * k[..., None, :, :] * segsum_exp_vec(G)).sum(-1)
    return scale * (A @ v + (q * G.exp()) @ state)


gla = variant("gla", chunk_mode=_gla_chunk, decay_mode=_gla_decay, merge_mode=_gla_merge,
              inputs={"q": "K", "k": "K", "v": "V", "g": "K"}, chunk_size=16)


# gated_delta_rule: WY form; the dense transition is exp(G_C) I - Kt^T W ---------------------
def _gdn_chunk(k, v, g, beta):
    G = g.cumsum(-1)
    system = eye_like(k) + beta[..., None] * (k @ T(k)) * segsum_exp(G, strict=True)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False,  # noqa: E731
                                                      unitriangular=True)
    u = cache("u", solve(beta[..., None] * v))
    cache("w", solve((beta * G.exp())[..., None] * k))  # read by the decay mode
    kt = cache("kt", k * (G[..., -1:] - G).exp()[..., None])
    return T(kt) @ u


def _gdn_decay(state, chunk_state, g, kt, w):
    return state * g.sum(-1).exp()[..., None, None] - T(kt) @ (w @ state) + chunk_state


def _gdn_merge(state, q, k, g, u, w, scale):
    G = g.cumsum(-1)
    A = (q @ T(k)) * segsum_exp(G)
    return scale * (A @ (u - w @ state) + (q * G.exp()[..., None]) @ state)


gated_delta_rule = variant("gated_delta_rule", chunk_mode=_gdn_chunk, decay_mode=_gdn_decay,
                           merge_mode=_gdn_merge, inputs=("q", "k", "v", "g", "beta"))


# hgrn: vector state h' = exp(g) * h + x, o = h -------------------------------------------
def _hgrn_chunk(x, g):
    h = cache("h", (segsum_exp_vec(g.cumsum(-2)) * x[..., None, :, :]).sum(-2))
    return h[..., -1, :]


def _hgrn_decay(state, chunk_state, g):
    return state * g.sum(-2).exp() + chunk_state


def _hgrn_merge(state, h, g):
    return h + g.cumsum(-2).exp() * state[..., None, :]


hgrn = variant("hgrn", chunk_mode=_hgrn_chunk, decay_mode=_hgrn_decay, merge_mode=_hgrn_merge,
               state="vector", inputs=("x", "g"), chunk_size=16)

BUILTINS = {"linear_attn": linear_attn, "simple_gla": simple_gla, "gla": gla,
            "gated_delta_rule": gated_delta_rule, "hgrn": hgrn}

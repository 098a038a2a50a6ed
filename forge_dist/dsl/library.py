"""Variants with no hand-written kernel, written only in the DSL (fp64 references:
:mod:`forge_dist.dsl.references`).

* ``elu_linear_attn``: linear attention with the ELU+1 feature map on q and k (identity);
* ``retnet``: RetNet's multi-scale retention, a fixed decay per head
  ``gamma_h = 1 - 2^(-5-h)`` (scalar), any K != V;
* ``rg_lru``: Hawk / Griffin's RG-LRU (vector state, diagonal):
  ``log a_t = -8 softplus(-lam_t) sigmoid(r_t)``,
  ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (sigmoid(i_t) x_t)``, ``o_t = h_t``
  (``lam`` is the learnt ``Lambda`` broadcast to ``[B, T, D]``).
"""
import torch
import torch.nn.functional as F

from .api import variant
from .helpers import segsum_exp, segsum_exp_vec
from .trace import cache

T = lambda x: x.transpose(-1, -2)  # noqa: E731


# ELU+1 feature-map linear attention ------------------------------------------------------
def phi(x):
    return F.elu(x) + 1.0


def _elu_chunk(k, v):
    return T(phi(k)) @ v


def _elu_decay(state, chunk_state):
    return state + chunk_state


def _elu_merge(state, q, k, v, scale):
    qf = phi(q)
    return scale * ((qf @ T(phi(k))).tril() @ v + qf @ state)


elu_linear_attn = variant("elu_linear_attn", chunk_mode=_elu_chunk, decay_mode=_elu_decay,
                          merge_mode=_elu_merge, inputs=("q", "k", "v"))


# RetNet multi-scale retention ------------------------------------------------------------
def retnet_log_decay(x):
    """Per-token log decays ``[B, H, NT, C]`` from a chunk tensor ``x [B, H, NT, C, *]``."""
    h = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
    return torch.zeros_like(x[..., 0]) + torch.log(1 - 2.0 ** (-5.0 - h))[:, None, None]


def _ret_chunk(k, v):
    G = retnet_log_decay(k).cumsum(-1)
    return T(k * (G[..., -1:] - G).exp()[..., None]) @ v


def _ret_decay(state, chunk_state, k):
    return state * retnet_log_decay(k).sum(-1).exp()[..., None, None] + chunk_state


def _ret_merge(state, q, k, v, scale):
    G = retnet_log_decay(k).cumsum(-1)
    return scale * (((q @ T(k)) * segsum_exp(G)) @ v + (q * G.exp()[..., None]) @ state)


retnet = variant("retnet", chunk_mode=_ret_chunk, decay_mode=_ret_decay, merge_mode=_ret_merge,
                 inputs=("q", "k", "v"))


# Hawk / Griffin RG-LRU ------------------------------------------------------------------
def rg_lru_gates(x, r, i, lam):
    """``(log a, gated input)`` per token, ``[B, NT, C, D]`` each."""
    log_a = -8.0 * F.softplus(-lam) * torch.sigmoid(r)
    return log_a, torch.sqrt(-torch.expm1(2.0 * log_a)) * (torch.sigmoid(i) * x)


def _lru_chunk(x, r, i, lam):
    log_a, u = rg_lru_gates(x, r, i, lam)
    h = cache("h", (segsum_exp_vec(log_a.cumsum(-2)) * u[..., None, :, :]).sum(-2))
    return h[..., -1, :]


def _lru_decay(state, chunk_state, r, lam):
    return state * (-8.0 * F.softplus(-lam) * torch.sigmoid(r)).sum(-2).exp() + chunk_state


def _lru_merge(state, h, r, lam):
    G = (-8.0 * F.softplus(-lam) * torch.sigmoid(r)).cumsum(-2)
    return h + G.exp() * state[..., None, :]


rg_lru = variant("rg_lru", chunk_mode=_lru_chunk, decay_mode=_lru_decay, merge_mode=_lru_merge,
                 state="vector", inputs=("x", "r", "i", "lam"), chunk_size=16)

LIBRARY = {"elu_linear_attn": elu_linear_attn, "retnet": retnet, "rg_lru": rg_lru}

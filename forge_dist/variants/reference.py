"""Token-by-token recurrences: the oracle for every test (run them in fp64 on the CPU).

Formulas and argument order follow flash-linear-attention's ``naive`` recurrences
(docs/design.md section 1).  Tensors are ``[B, T, H, D]`` (HGRN ``[B, T, D]``); states are
``[B, H, K, V]`` (HGRN ``[B, D]``); gates are natural-log decays.  With ``cu_seqlens``
(``B == 1``) every packed sequence starts from ``initial_state[n]`` (or zeros) and the final
state has one row per sequence, ``[N, H, K, V]``.

Every function returns ``(o, final_state)`` with ``final_state=None`` unless asked for, and is
written for clarity, not speed.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _sequences(T: int, B: int, cu_seqlens: Optional[Tensor]):
    """Yield ``(batch_index, start, end, state_row)`` for every sequence."""
    if cu_seqlens is None:
        for b in range(B):
            yield b, 0, T, b
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        for n in range(len(bounds) - 1):
            yield 0, bounds[n], bounds[n + 1], n


def _matrix_recurrence(q, k, v, step, scale, initial_state, output_final_state, cu_seqlens):
    """Run ``S = step(S, t-inputs)``; ``o_t = (scale * q_t)^T S_t`` per head."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_states = B if cu_seqlens is None else len(cu_seqlens) - 1
    o = torch.zeros(B, T, H, V, dtype=q.dtype, device=q.device)
    finals = []
    for b, start, end, row in _sequences(T, B, cu_seqlens):
        S = (initial_state[row].to(q.dtype).clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=q.dtype, device=q.device))
        for t in range(start, end):
            S = step(S, b, t)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    assert final is None or final.shape[0] == n_states
    return o, final


def _default_scale(q: Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def linear_attn_ref(q, k, v, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None):
    """``S_t = S_{t-1} + k_t v_t^T``."""
    scale = _default_scale(q, scale)

    def step(S, b, t):
        return S + k[b, t, :, :, None] * v[b, t, :, None, :]
    return _matrix_recurrence(q, k, v, step, scale, initial_state, output_final_state, cu_seqlens)


def simple_gla_ref(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                   output_final_state=False, cu_seqlens=None):
    """``S_t = exp(g_t) S_{t-1} + k_t v_t^T`` with ``g [B, T, H]`` or a per-head ``g_gamma [H]``."""
    scale = _default_scale(q, scale)

    def step(S, b, t):
        decay = torch.zeros(q.shape[2], dtype=q.dtype, device=q.device)
        if g is not None:
            decay = decay + g[b, t]
        if g_gamma is not None:
            decay = decay + g_gamma
        return decay.exp()[:, None, None] * S + k[b, t, :, :, None] * v[b, t, :, None, :]
    return _matrix_recurrence(q, k, v, step, scale, initial_state, output_final_state, cu_seqlens)


def gla_ref(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None):
    """``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T`` with ``g [B, T, H, K]``."""
    scale = _default_scale(q, scale)

    def step(S, b, t):
        return g[b, t].exp()[:, :, None] * S + k[b, t, :, :, None] * v[b, t, :, None, :]
    return _matrix_recurrence(q, k, v, step, scale, initial_state, output_final_state, cu_seqlens)


def gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None,
                         use_qk_l2norm_in_kernel=False):
    """``S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``; ``g=None`` is DeltaNet.

    Written as FLA's naive recurrence does it: decay, then the delta correction
    ``v' = b_t (v_t - S^T k_t)``, then ``S += k_t v'^T``.
    """
    scale = _default_scale(q, scale)
    if use_qk_l2norm_in_kernel:
        # FLA's form, spelled out here (the reference does not call the ops' helper)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)

    def step(S, b, t):
        if g is not None:
            S = g[b, t].exp()[:, None, None] * S
        v_new = beta[b, t][:, None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S))
        return S + k[b, t, :, :, None] * v_new[:, None, :]
    return _matrix_recurrence(q, k, v, step, scale, initial_state, output_final_state, cu_seqlens)


def hgrn_ref(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
    """``h_t = exp(g_t) * h_{t-1} + x_t``, ``o_t = h_t``, with ``x, g [B, T, D]``."""
    B, T, D = x.shape
    o = torch.zeros_like(x)
    finals = []
    for b, start, end, row in _sequences(T, B, cu_seqlens):
        h = (initial_state[row].to(x.dtype).clone() if initial_state is not None
             else torch.zeros(D, dtype=x.dtype, device=x.device))
        for t in range(start, end):
            h = g[b, t].exp() * h + x[b, t]
            o[b, t] = h
        finals.append(h)
    return o, (torch.stack(finals) if output_final_state else None)

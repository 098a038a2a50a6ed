"""fp64 token-by-token references for the DSL-only variants of :mod:`.library`.

Same conventions as :mod:`forge_dist.variants.reference`: ``[B, T, H, D]`` tensors (vector
state ``[B, T, D]``), states ``[B, H, K, V]`` (``[B, D]``), ``cu_seqlens`` restarts every packed
sequence from ``initial_state[n]``; returns ``(o, final_state or None)``.
"""

import torch
import torch.nn.functional as F


def _sequences(T, B, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T, b) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]


def _matrix(q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens):
    """``S_t = decay[h] * S_{t-1} + k_t v_t^T``; ``o_t = (scale q_t)^T S_t``; decay ``[H]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, T, H, V, dtype=q.dtype)
    finals = []
    for b, lo, hi, row in _sequences(T, B, cu_seqlens):
        S = initial_state[row].clone() if initial_state is not None else q.new_zeros(H, K, V)
        for t in range(lo, hi):
            S = decay[:, None, None] * S + k[b, t, :, :, None] * v[b, t, :, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", scale * q[b, t], S)
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)


def elu_linear_attn_ref(q, k, v, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None):
    """Linear attention on ``elu(q)+1``, ``elu(k)+1`` (scale default ``K ** -0.5``)."""
    phi = lambda x: F.elu(x) + 1.0  # noqa: E731
    return _matrix(phi(q), phi(k), v, q.new_ones(q.shape[2]), scale, initial_state,
                   output_final_state, cu_seqlens)


def retnet_ref(q, k, v, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None):
    """Retention with ``gamma_h = 1 - 2^(-5-h)``."""
    H = q.shape[2]
    gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=q.dtype)
    return _matrix(q, k, v, gamma, scale, initial_state, output_final_state, cu_seqlens)


def rg_lru_ref(x, r, i, lam, initial_state=None, output_final_state=False, cu_seqlens=None):
    """``a = sigmoid(lam)^(8 sigmoid(r))``; ``h = a h + sqrt(1 - a^2) (sigmoid(i) x)``."""
    B, T, D = x.shape
    o = torch.zeros_like(x)
    finals = []
    for b, lo, hi, row in _sequences(T, B, cu_seqlens):
        h = initial_state[row].clone() if initial_state is not None else x.new_zeros(D)
        for t in range(lo, hi):
            a = torch.sigmoid(lam[b, t]) ** (8.0 * torch.sigmoid(r[b, t]))
            h = a * h + torch.sqrt(1 - a * a) * (torch.sigmoid(i[b, t]) * x[b, t])
            o[b, t] = h
        finals.append(h)
    return o, (torch.stack(finals) if output_final_state else None)

"""One recurrent step of each op, for single-token decoding from a cache (PyTorch, batched).

A decoding step is a handful of ``[B, H, K, V]`` element-wise products and two contractions;
the chunked ops of :mod:`forge_dist.ops` would run their whole chunk machinery (and, on one
GPU, their plan lookup) for one token.  Every function takes the op's arguments for one token
(``T == 1``, FLA's shapes) and the state in our ops' layout, computes in fp32 (fp64 for fp64
inputs), and returns ``(o, new_state)`` with ``o`` in the inputs' dtype and the state in fp32
(fp64), as the ops return them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..variants.delta_rule import l2_normalize


def _wide(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _matrix_step(q: Tensor, k: Tensor, v: Tensor, S: Optional[Tensor], scale, decay=None,
                 beta=None) -> Tuple[Tensor, Tensor]:
    """``q, k [B, 1, H, K]``, ``v [B, 1, H, V]``, ``S [B, H, K, V]``; ``decay`` multiplies
    ``S`` (broadcast to it), ``beta [B, H]`` makes the write a delta-rule correction."""
    wide = _wide(q)
    q, k, v = (t[:, 0].to(wide) for t in (q, k, v))
    B, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if S is None else S.to(wide)
    if decay is not None:
        S = S * decay
    if beta is not None:
        v = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., :, None] * v[..., None, :]
    scale = K ** -0.5 if scale is None else scale
    o = torch.einsum("bhk,bhkv->bhv", q * scale, S)
    return o[:, None], S


def _out(o: Tensor, like: Tensor) -> Tensor:
    return o.to(like.dtype)


def linear_attn(q, k, v, *, scale=None, initial_state=None, **_):
    o, S = _matrix_step(q, k, v, initial_state, scale)
    return _out(o, v), S


def simple_gla(q, k, v, g=None, g_gamma=None, *, scale=None, initial_state=None, **_):
    wide = _wide(q)
    log = g[:, 0].to(wide) if g is not None else g_gamma.to(wide)[None]  # [B, H] / [1, H]
    o, S = _matrix_step(q, k, v, initial_state, scale, decay=log.exp()[..., None, None])
    return _out(o, v), S


def gla(q, k, v, g, *, scale=None, initial_state=None, **_):
    decay = g[:, 0].to(_wide(q)).exp()[..., None]  # [B, H, K, 1]
    o, S = _matrix_step(q, k, v, initial_state, scale, decay=decay)
    return _out(o, v), S


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     use_qk_l2norm_in_kernel=False, **_):
    wide = _wide(q)
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.to(wide)), l2_normalize(k.to(wide))
    decay = None if g is None else g[:, 0].to(wide).exp()[..., None, None]
    o, S = _matrix_step(q, k, v, initial_state, scale, decay=decay,
                        beta=beta[:, 0].to(wide))
    return _out(o, v), S


def hgrn(x, g, *, initial_state=None, **_):
    wide = _wide(x)
    h = x[:, 0].to(wide) if initial_state is None else \
        g[:, 0].to(wide).exp() * initial_state.to(wide) + x[:, 0].to(wide)
    return h[:, None].to(x.dtype), h


def mamba2_ssd(x, dt, A, B, C, D=None, *, initial_state=None, **_):
    """:func:`forge_dist.ops.mamba2_ssd` for one token: ``q = C, k = B, v = x * dt``,
    ``g = A * dt``, scale 1, plus the ``D`` skip."""
    rep = x.shape[2] // B.shape[2]
    k, q = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    v = x * dt[..., None].to(x.dtype)
    y, S = simple_gla(q, k, v, g=A.to(dt.dtype) * dt, scale=1.0, initial_state=initial_state)
    if D is not None:
        y = y + (D[:, None] * x).to(y.dtype)
    return y, S


#: op name -> its one-token step
STEPS = {"linear_attn": linear_attn, "simple_gla": simple_gla, "gla": gla,
         "gated_delta_rule": gated_delta_rule, "hgrn": hgrn, "mamba2_ssd": mamba2_ssd}

"""The generated path's inter-chunk state pass as one Triton kernel (identity, scalar and
diagonal transitions, forward only).

The executor's scan (:func:`forge_dist.variants.chunked.scan_chunks`) is a Python loop over
the chunks, two or three small launches per chunk: at 16K tokens and 32-token chunks, a
thousand launches.  Here one program per ``(BLOCK elements of a head's state, batch-head)``
walks the chunks in registers: ``starts[c] = S; S = m_c * S + b_c``, reading every chunk's
``b_c`` once and writing its start state once.  It has no backward: calls that need
gradients (and dense transitions, a K x K product per chunk) keep the loop.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..variants import chunked as ck
from ..variants.transitions import Kind
from .placement import use_kernels

BLOCK = 512


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton  # optional: the gpu extra (eligible() checks it)
    import triton.language as tl

    @triton.jit
    def affine_scan(b, m, s0, starts, final, NT, R, V, s_mbh, s_mc, s_mr,
                    HAS_M: tl.constexpr, HAS_S0: tl.constexpr, BLOCK: tl.constexpr):
        """Per batch-head ``bh`` (states of ``R * V`` elements, ``R`` rows): for each chunk
        ``c``, ``starts[bh, c] = S`` then ``S = m[bh, c, row] * S + b[bh, c]``; ``final[bh]
        = S``.  ``b``, ``starts`` ``[BH, NT, R * V]`` fp32; ``m`` by strides (0 where it
        broadcasts)."""
        i_blk, i_bh = tl.program_id(0), tl.program_id(1)
        o = i_blk * BLOCK + tl.arange(0, BLOCK)
        mask = o < R * V
        row = o // V
        base = i_bh.to(tl.int64) * NT * R * V
        if HAS_S0:
            S = tl.load(s0 + i_bh.to(tl.int64) * R * V + o, mask=mask, other=0.0).to(tl.float32)
        else:
            S = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, NT):
            off = base + c * R * V + o
            tl.store(starts + off, S, mask=mask)
            if HAS_M:
                f = tl.load(m + i_bh.to(tl.int64) * s_mbh + c * s_mc + row * s_mr, mask=mask,
                            other=0.0)
                S = f * S
            S = S + tl.load(b + off, mask=mask, other=0.0)
        tl.store(final + i_bh.to(tl.int64) * R * V + o, S, mask=mask)
    return affine_scan


def eligible(kind: Kind, M_c: Optional[Tensor], dS_c: Tensor,
             S0: Optional[Tensor]) -> bool:
    """The kernel can run this scan: not dense, fp32, a device Triton runs on, and no
    gradient asked of any operand."""
    if kind is Kind.DENSE or dS_c.dtype != torch.float32 or not use_kernels(dS_c.device):
        return False
    try:
        import triton  # noqa: F401  (optional: the gpu extra)
    except ImportError:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (M_c, dS_c, S0)):
        return False
    return True


def scan_chunks(kind: Kind, M_c: Optional[Tensor], dS_c: Tensor,
                S0: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`forge_dist.variants.chunked.scan_chunks` (same arguments and results:
    ``dS_c [B, H, NT, R, V]``, ``M_c`` ``[B, H, NT]`` (scalar) / ``[B, H, NT, R]``
    (diagonal) / ``None``), as one kernel where :func:`eligible`, else the loop."""
    if not eligible(kind, M_c, dS_c, S0):
        return ck.scan_chunks(kind, M_c, dS_c, S0)
    B, H, NT, R, V = dS_c.shape
    b = dS_c.reshape(B * H, NT, R * V).contiguous()
    starts = torch.empty_like(b)
    final = torch.empty(B * H, R * V, dtype=b.dtype, device=b.device)
    if M_c is None or kind is Kind.IDENTITY:
        m, strides, has_m = b, (0, 0, 0), False
    else:
        m = (M_c[..., None] if kind is Kind.SCALAR else M_c).to(torch.float32)
        m = m.expand(B, H, NT, R).reshape(B * H, NT, R)  # stride 0 where it broadcasts
        strides, has_m = (m.stride(0), m.stride(1), m.stride(2)), True
    s0 = S0.reshape(B * H, R * V).to(torch.float32).contiguous() if S0 is not None else b
    grid = (-(-(R * V) // BLOCK), B * H)
    _kernel()[grid](b, m, s0, starts, final, NT, R, V, *strides, HAS_M=has_m,
                    HAS_S0=S0 is not None, BLOCK=BLOCK)
    return starts.reshape(B, H, NT, R, V), final.reshape(B, H, R, V)

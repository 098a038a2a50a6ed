"""``@triton.jit`` tile helpers shared by the kernels of several patterns.

:func:`reset_floor` (a hard reset, ``g = -inf``, read as :data:`HARD_RESET`),
:func:`mapped_tile` (a loaded tile through a fused prologue), :func:`scalar_gate_chunk` (a
chunk's cumulative scalar log decay) and :func:`value_state_tiles` (the chunk-parallel
backward kernels' value and state tiles).  ``None`` without Triton.
"""
from __future__ import annotations

from .compat import HAVE_TRITON, tl, triton


# defined below when Triton is installed
scalar_gate_chunk = value_state_tiles = mapped_tile = reset_floor = None
if HAVE_TRITON:
    # A hard reset, g = -inf, is read as this log decay.  exp(-112) rounds to 0 in fp32
    # (its smallest subnormal is exp(-103.3)), and with decays g <= 0 every decay across the
    # reset is at most exp(-112): the state is forgotten exactly as by -inf, while every
    # in-chunk cumulative sum stays finite (after a -inf, G_i - G_j was -inf - -inf = NaN).
    # The cost: the sums after a reset carry its offset, so a decay between two later tokens
    # of the same chunk loses about 112 * 2**-24 (~7e-6) of absolute precision in its
    # exponent per reset before them in the chunk (~1e-5 relative error in fp32 outputs
    # with a few resets per chunk, nothing beside bf16's rounding).  The PyTorch chunk forms
    # are exact (forge_dist.variants.chunked.LogDecay).
    HARD_RESET = tl.constexpr(-112.0)

    @triton.jit
    def reset_floor(b_g):
        """Log decays read with a hard reset (``-inf``) as :data:`HARD_RESET` (one max per
        element, in registers: no pass of its own)."""
        # HARD_RESET written out: a global here made Triton's source hash (the AOT cache's
        # key) depend on how the module was imported (python -m gave another hash)
        return tl.maximum(b_g, -112.0)

    @triton.jit
    def mapped_tile(x, MAP: tl.constexpr, r0, R, c0, C, BR: tl.constexpr, BC: tl.constexpr):
        """A loaded ``[BR, BC]`` tile (rows from ``r0``, columns from ``c0``) through a fused
        prologue ``MAP`` (:mod:`forge_dist.dsl.codegen`), computed in fp32 and rounded back to
        the tile's dtype; what the load padded (rows past ``R``, columns past ``C``) stays 0,
        as the unmapped walk assumes (``MAP(0)`` need not be 0)."""
        o_r = r0 + tl.arange(0, BR)
        o_c = c0 + tl.arange(0, BC)
        keep = (o_r < R)[:, None] & (o_c < C)[None, :]
        return tl.where(keep, MAP(x.to(tl.float32)), 0.0).to(x.dtype)

    @triton.jit
    def scalar_gate_chunk(g, bos, t0, T, i_h, H: tl.constexpr, BT: tl.constexpr):
        """In-chunk cumulative log decay ``G [BT]`` and chunk total ``G_C`` of head ``i_h``
        from per-token scalar gates ``g [B, T, H]`` (padding past ``T`` reads 0)."""
        o_g = t0 + tl.arange(0, BT)
        b_g = reset_floor(tl.load(g + (bos + o_g) * H + i_h, mask=o_g < T,
                                  other=0.0).to(tl.float32))
        return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)

    @triton.jit
    def value_state_tiles(v, do, h, dh, bos, i_h, t0, i_v, i_k, base_h, T, H: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr):
        """One V tile of a chunk, for the chunk-parallel backward kernels: values and output
        gradients ``[BT, BV]`` (``[B, T, H, V]`` tensors, rows from token ``t0``) and the
        chunk's state and state gradient read transposed, ``[BV, BK]`` (``[K, V]`` tiles at
        ``base_h``).  As loaded: the callers cast to their dot dtype."""
        p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV),
                                (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1), (t0, i_v * BV),
                                 (BT, BV), (1, 0))
        p_ht = tl.make_block_ptr(h + base_h, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK),
                                 (0, 1))
        p_dht = tl.make_block_ptr(dh + base_h, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK),
                                  (0, 1))
        return (tl.load(p_v, boundary_check=(0, 1)), tl.load(p_do, boundary_check=(0, 1)),
                tl.load(p_ht, boundary_check=(0, 1)), tl.load(p_dht, boundary_check=(0, 1)))

"""FLA's inference cache for the layers of :mod:`forge_dist.nn.layers`: prefill and decoding.

FLA's models hand every layer ``past_key_values`` (``fla.models.utils.Cache``, or any object
with its ``__len__``, ``__getitem__(layer_idx)`` and ``update(layer_idx=..., ...)``) and
``use_cache``.  A layer reads its entry ``{"recurrent_state", "conv_state", ...}`` and writes
back what FLA's own layer would, in FLA's layouts, so a cache filled by a patched model can be
read by the unpatched one and back:

* ``conv_state``: per short convolution, the last ``W`` convolution *inputs* (before the
  activation) as ``[N, D, W]`` (``W`` = kernel size, newest last; zeros before the start);
* ``recurrent_state``: the op's final state in the layer's FLA layout (``[N, H, V, K]`` for
  the layers FLA runs with ``state_v_first``, ``[N, H, K, V]`` otherwise, ``[N, D]`` for HGRN).

Sequence parallel prefill: the final state of the global sequence ends on the last rank, and
the convolution tails on the last ranks; :func:`gather_final_state` and :func:`conv_tail`
give every rank the full cache, so decoding runs on any rank (each rank holds the whole
decoded token and runs it with ``group=None``).  Decoding itself is the op called on the new
tokens with ``initial_state`` (PyTorch path on the CPU, the Triton kernels on CUDA), or for
one token its recurrent step in PyTorch (:mod:`forge_dist.nn.decode`), and
:func:`conv_step` for the convolutions.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..sp import p2p
from ..variants.delta_rule import l2_normalize
from . import decode
from .halo import halo_exchanges


def layer_state(layer, past_key_values) -> Optional[dict]:
    """The layer's cache entry, or ``None`` before its first update (FLA's
    ``get_layer_cache``)."""
    if past_key_values is None:
        return None
    if layer.layer_idx is None:
        raise ValueError(f"{type(layer).__name__}: layer_idx is None; a layer needs its index "
                         f"in the model to use past_key_values")
    if len(past_key_values) > layer.layer_idx:
        return past_key_values[layer.layer_idx]
    return None


def seen_tokens(layer, past_key_values) -> int:
    """Tokens the cache has seen before this call (the rotary offset)."""
    if past_key_values is None:
        return 0
    return int(past_key_values.get_seq_length(layer.layer_idx))


def update_layer_state(layer, past_key_values, *, recurrent_state, conv_state, offset: int):
    """Write the layer's entry (FLA's ``update_layer_cache``)."""
    if past_key_values is not None:
        past_key_values.update(recurrent_state=recurrent_state, conv_state=conv_state,
                               layer_idx=layer.layer_idx, offset=offset)


def conv_tail(x: Tensor, width: int, group) -> Tensor:
    """The last ``width`` tokens of the *global* sequence as FLA's conv state ``[B, D, W]``.

    ``x [B, T_local, D]`` is this rank's shard of the convolution's input; earlier tokens
    come from earlier ranks when the last shard is shorter than ``width``; positions before
    the sequence start are zeros.  Every rank gets the same result.
    """
    T = x.shape[1]
    tail = x[:, T - min(T, width):]
    if p2p.rank_and_size(group)[1] > 1:
        # equal shards: the ranks' last min(T, W) tokens are contiguous in the global order
        tail = torch.cat(p2p.all_gather(tail, group, "the convolution tails"),
                         dim=1)[:, -width:]
    if tail.shape[1] < width:
        tail = F.pad(tail, (0, 0, width - tail.shape[1], 0))
    return tail.transpose(1, 2).contiguous()


def gather_final_state(state: Tensor, group) -> Tensor:
    """The last rank's final state (the global sequence's), on every rank."""
    _, size = p2p.rank_and_size(group)
    if size == 1:
        return state
    state = state.contiguous()
    dist.broadcast(state, src=dist.get_global_rank(group, size - 1), group=group)
    return state


def conv_step(conv, x: Tensor, cache: Tensor) -> Tuple[Tensor, Tensor]:
    """The causal depthwise convolution ``conv`` over new tokens after a cached prefix.

    Args:
        conv: a :class:`forge_dist.nn.conv.ShortConvolution` (``weight [D, 1, W]``, ``bias``,
            ``activation``).
        x: ``[B, T, D]`` new inputs; cache: ``[B, D, W]`` the previous ``W`` inputs.
    Returns:
        ``y [B, T, D]`` and the new cache ``[B, D, W]`` (the last ``W`` inputs).
    """
    W = conv.weight.shape[-1]
    ext = torch.cat([cache.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W + T, D]
    windows = ext[:, 1:].unfold(1, W, 1)  # [B, T, D, W]: inputs t-W+1 .. t
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = (windows.to(wide) * conv.weight[:, 0].to(wide)).sum(-1)
    if conv.bias is not None:
        y = y + conv.bias.to(wide)
    if conv.activation in ("silu", "swish"):
        y = F.silu(y)
    new_cache = ext[:, -W:].transpose(1, 2).to(cache.dtype).contiguous()
    return y.to(x.dtype), new_cache


def to_fla_layout(state: Optional[Tensor], v_first: bool) -> Optional[Tensor]:
    """Our ops' ``[N, H, K, V]`` state -> FLA's (``[N, H, V, K]`` when ``v_first``)."""
    if state is None or not v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def from_fla_layout(state: Optional[Tensor], v_first: bool) -> Optional[Tensor]:
    """FLA's cached state -> our ops' ``[N, H, K, V]``."""
    if state is None or not v_first:
        return state
    return state.transpose(-1, -2).contiguous()


class CacheCall:
    """One forward call's cache bookkeeping (FLA's ``get_layer_cache`` ... ``update_layer_cache``).

    Without a cache entry for the layer the call is a (possibly sequence-parallel) prefill:
    convolutions and the op run as usual, and with ``use_cache`` their final states are
    gathered to every rank.  With an entry, the call continues it on this rank alone
    (``group`` becomes ``None``): the convolutions through :func:`conv_step`, the op from the
    cached ``initial_state``.
    """

    def __init__(self, layer, past_key_values, use_cache: bool, group, cu_seqlens,
                 num_tokens: int):
        self.layer, self.past_key_values = layer, past_key_values
        self.last = layer_state(layer, past_key_values)
        self.use_cache = bool(use_cache) or past_key_values is not None
        self.offset = seen_tokens(layer, past_key_values) if self.last is not None else 0
        self.group = None if self.last is not None else group
        # the cache counts the tokens of the global sequence (the rotary offset of decoding)
        self.cu_seqlens = cu_seqlens
        self.num_tokens = num_tokens * p2p.rank_and_size(self.group)[1]
        if self.use_cache and cu_seqlens is not None:
            raise NotImplementedError(f"{type(layer).__name__}: caches (use_cache / "
                                      f"past_key_values) with cu_seqlens are not supported")
        self.conv_states = []
        self.recurrent_state = None

    def convs(self, *calls) -> List[Tensor]:
        """Several convolutions of the layer, each ``(conv, x)`` or ``(conv, x,
        l2norm_head_dim)``, as :meth:`conv` makes them; with a group their halos travel in
        one exchange (:func:`forge_dist.nn.halo.halo_exchanges`)."""
        halos = [None] * len(calls)
        widths = {c[0].kernel_size[0] - 1 for c in calls}
        if (self.last is None and p2p.rank_and_size(self.group)[1] > 1 and len(widths) == 1
                and min(widths) > 0):
            halos = halo_exchanges([c[1] for c in calls], min(widths), self.group,
                                   getattr(self.layer, "strategy", "auto"))
        return [self.conv(*c, halo=h) for c, h in zip(calls, halos)]

    def conv(self, conv, x: Tensor, l2norm_head_dim: Optional[int] = None,
             halo: Optional[Tensor] = None) -> Tensor:
        """``conv`` over ``x [B, T, D]``; records its conv state when caching.
        ``l2norm_head_dim``: L2-normalise each head of the output (GatedDeltaNet's q, k);
        ``halo``: exchanged already (:meth:`convs`)."""
        if self.last is not None:
            cached = self.last["conv_state"]
            cached = cached[len(self.conv_states)] if isinstance(cached, (tuple, list)) else cached
            y, state = conv_step(conv, x, cached)
            if l2norm_head_dim is not None:
                y = l2_normalize(y.unflatten(-1, (-1, l2norm_head_dim))).flatten(-2)
        else:
            y = conv(x, cu_seqlens=self.cu_seqlens, group=self.group,
                     l2norm_head_dim=l2norm_head_dim, halo=halo,
                     strategy=getattr(self.layer, "strategy", "auto"))
            state = conv_tail(x, conv.weight.shape[-1], self.group) if self.use_cache else None
        self.conv_states.append(state)
        return y

    def op(self, name: str, *args, **kwargs):
        """The op ``name`` of :mod:`forge_dist.ops` (through the layer's choice of eager or
        custom ops) with the cached ``initial_state``; returns its output and keeps its final
        state in FLA's layout.  One token after a cache takes the op's recurrent step
        (:mod:`forge_dist.nn.decode`) instead."""
        v_first = self.layer.state_v_first
        initial = None
        if self.last is not None and self.last.get("recurrent_state") is not None:
            initial = from_fla_layout(self.last["recurrent_state"], v_first)
        if self.last is not None and self.num_tokens == 1:
            fn = decode.STEPS[name]
        elif name == "mamba2_ssd":  # a composition of simple_gla, not a custom op itself
            fn = ops.mamba2_ssd
        else:
            fn = self.layer._op(name)
        o, state = fn(*args, initial_state=initial, output_final_state=self.use_cache,
                      **kwargs)
        if state is not None:
            self.recurrent_state = to_fla_layout(gather_final_state(state, self.group),
                                                 v_first)
        return o

    def finish(self):
        """Write the layer's entry; returns ``past_key_values`` (FLA's third output)."""
        if self.past_key_values is not None:
            convs = self.conv_states
            conv_state = None if not convs else (convs[0] if len(convs) == 1 and
                                                 self.layer.single_conv_state else tuple(convs))
            update_layer_state(self.layer, self.past_key_values,
                               recurrent_state=self.recurrent_state, conv_state=conv_state,
                               offset=self.num_tokens)
        return self.past_key_values

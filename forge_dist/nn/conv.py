"""FLA's ``ShortConvolution`` (causal depthwise conv1d), sequence-parallel and varlen-aware.

Same parameters as ``fla.modules.ShortConvolution`` / the ``nn.Conv1d`` of Mamba2
(``weight [D, 1, K]``, optional ``bias [D]``), so FLA state dicts load.  Output
``y_t = act(sum_i weight[:, 0, i] * x_{t - (K-1) + i} + bias)``.  Under sequence
parallelism the first ``K-1`` taps of a shard read the previous rank's last ``K-1`` inputs
through :func:`forge_dist.nn.halo.halo_exchange`; with ``cu_seqlens`` taps that would reach
back past the start of a token's packed sequence read zero, exactly as FLA's varlen conv.

On CUDA (and under ``TRITON_INTERPRET=1`` with ``FORGE_DIST_KERNELS=triton``) the convolution
runs as the fused kernels of :mod:`forge_dist.kernels.short_conv`: one pass in the ``[B, T, D]``
layout that reads the halo in place (no concatenation, no transposes) and saves only its input
and halo; elsewhere it runs the PyTorch formula below.  :meth:`ShortConvolution.step` is the
single-token decoding update with FLA's conv cache ``[B, D, K]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..kernels.short_conv import MAX_WIDTH, l2norm_supported, short_conv, short_conv_step
from ..variants.delta_rule import l2_normalize
from .fused import use_fused
from .halo import halo_exchange
from .shard import positions

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over ``[B, T, D]`` inputs.

    Args:
        hidden_size: channels ``D``.
        kernel_size: taps ``K`` (the halo is ``K - 1`` tokens).
        bias: learnable bias.
        activation: ``"silu"``/``"swish"`` or ``None``.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: Optional[str] = "silu", device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size,
                         padding=kernel_size - 1, bias=bias, device=device, dtype=dtype)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got "
                             f"{activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x: Tensor, *, cu_seqlens: Optional[Tensor] = None, group=None,
                l2norm_head_dim: Optional[int] = None, halo: Optional[Tensor] = None,
                strategy: str = "auto", **unused) -> Tensor:
        """``x [B, T_local, D]`` -> ``[B, T_local, D]`` (this rank's shard).

        Args:
            cu_seqlens: global packed offsets (B=1), or ``None``.
            group: sequence-parallel process group, or ``None``.
            l2norm_head_dim: L2-normalise each head of this many channels of the output
                (``y / sqrt(|y|^2 + 1e-6)``, FLA's q/k normalisation), fused into
                the kernel where it can be.
            halo: ``[B, K-1, D]``, the previous rank's last inputs when the caller has
                exchanged them already (:func:`forge_dist.nn.halo.halo_exchanges`);
                ``None``: exchanged here when there is a group.
            strategy: the calling layer's state-pass strategy, which decides how the
                halo travels (:mod:`forge_dist.nn.halo`).
        """
        B, T, D = x.shape
        W = self.kernel_size[0] - 1
        if self._fused(x, l2norm_head_dim):
            # without a group there is no halo: the kernel reads zeros before the first token
            if halo is None and group is not None:
                halo = halo_exchange(x, W, group, strategy)
            pos = None if cu_seqlens is None else positions(T, group, cu_seqlens, x.device)
            return short_conv(x, self.weight, self.bias, halo, pos, self.activation,
                              l2norm_head_dim)
        y = self._torch_forward(x, cu_seqlens, group, halo, strategy)
        if l2norm_head_dim is None:
            return y
        heads = y.reshape(B, T, D // l2norm_head_dim, l2norm_head_dim)
        return l2_normalize(heads).reshape(B, T, D)

    def _torch_forward(self, x: Tensor, cu_seqlens: Optional[Tensor], group,
                       halo: Optional[Tensor] = None, strategy: str = "auto") -> Tensor:
        B, T, D = x.shape
        W = self.kernel_size[0] - 1
        if halo is None:
            halo = halo_exchange(x, W, group, strategy)  # zeros on rank 0 / without a group
        pos = None if cu_seqlens is None else positions(T, group, cu_seqlens, x.device)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            # Keep x and the halo, recompute the window, the taps and the activation in the
            # backward: saves the concatenated window and the pre-activation (two copies of
            # the activation per convolution).  The halo is exchanged outside, so the
            # recomputation sends nothing.
            return checkpoint(self._local, x, halo, pos, use_reentrant=False)
        return self._local(x, halo, pos)

    def _fused(self, x: Tensor, l2norm_head_dim: Optional[int] = None) -> bool:
        """Whether the Triton kernels run this call (a float input on a device they take)."""
        if not (x.is_floating_point() and use_fused(x.device)):
            return False
        return self.kernel_size[0] <= MAX_WIDTH and (
            l2norm_head_dim is None or l2norm_supported(x.shape[-1], l2norm_head_dim))

    def step(self, x: Tensor, cache: Tensor, l2norm_head_dim: Optional[int] = None) -> Tensor:
        """One decoding step: ``x [B, D]`` (or ``[B, 1, D]``), ``cache [B, D, K]`` (FLA's conv
        state: the last ``K`` inputs, oldest first; shifted in place) -> ``y`` like ``x``.
        ``l2norm_head_dim`` normalises heads as :meth:`forward` does."""
        y = self._step(x, cache)
        if l2norm_head_dim is None:
            return y
        heads = y.reshape(*y.shape[:-1], y.shape[-1] // l2norm_head_dim, l2norm_head_dim)
        return l2_normalize(heads).reshape(y.shape)

    def _step(self, x: Tensor, cache: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(shape[0], shape[-1])
        K = self.kernel_size[0]
        if tuple(cache.shape) != (x2.shape[0], self.hidden_size, K):
            raise ValueError(f"cache: expected [B, D, K] = {[x2.shape[0], self.hidden_size, K]},"
                             f" got {list(cache.shape)}")
        if self._fused(x2) and cache.is_contiguous():
            return short_conv_step(x2, cache, self.weight, self.bias,
                                   self.activation).reshape(shape)
        cache.copy_(torch.cat([cache[:, :, 1:], x2[:, :, None].to(cache.dtype)], dim=-1))
        y = (cache * self.weight[:, 0].to(cache.dtype)).sum(-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        act = _ACTIVATIONS[self.activation]
        y = y if act is None else act(y)
        return y.to(x.dtype).reshape(shape)

    def _local(self, x: Tensor, halo: Tensor, pos: Optional[Tensor]) -> Tensor:
        """The convolution of one shard given its halo: ``x [B, T, D]``, ``halo [B, K-1, D]``,
        ``pos [T]`` (position in its packed sequence, or ``None``) -> ``[B, T, D]``."""
        T, D = x.shape[1], x.shape[2]
        W = self.kernel_size[0] - 1
        ext = torch.cat([halo, x], dim=1)  # [B, W + T, D]
        weight = self.weight.to(x.dtype)
        if pos is None:
            y = F.conv1d(ext.transpose(1, 2), weight, None, groups=D).transpose(1, 2)
        else:
            # Tap j reads token t - j; it exists in t's sequence only when pos_in_seq >= j.
            y = x * weight[:, 0, W]
            for j in range(1, W + 1):
                keep = (pos >= j).to(x.dtype)[None, :, None]
                y = y + ext[:, W - j:W - j + T] * weight[:, 0, W - j] * keep
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        act = _ACTIVATIONS[self.activation]
        return y if act is None else act(y)

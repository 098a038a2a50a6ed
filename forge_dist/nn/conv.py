"""FLA's ``ShortConvolution`` (causal depthwise conv1d), sequence-parallel and varlen-aware.

Same parameters as ``fla.modules.ShortConvolution`` / the ``nn.Conv1d`` of Mamba2
(``weight [D, 1, K]``, optional ``bias [D]``), so FLA state dicts load.  Output
``y_t = act(sum_i weight[:, 0, i] * x_{t - (K-1) + i} + bias)``.  Under sequence
parallelism the first ``K-1`` taps of a shard read the previous rank's last ``K-1`` inputs
through :func:`forge_dist.nn.halo.halo_exchange`; with ``cu_seqlens`` taps that would reach
back past the start of a token's packed sequence read zero, exactly as FLA's varlen conv.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

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
                **unused) -> Tensor:
        """``x [B, T_local, D]`` -> ``[B, T_local, D]`` (this rank's shard).

        Args:
            cu_seqlens: global packed offsets (B=1), or ``None``.
            group: sequence-parallel process group, or ``None``.
        """
        B, T, D = x.shape
        W = self.kernel_size[0] - 1
        halo = halo_exchange(x, W, group)  # zeros on rank 0 / without a group
        pos = None if cu_seqlens is None else positions(T, group, cu_seqlens, x.device)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            # Keep x and the halo, recompute the window, the taps and the activation in the
            # backward: saves the concatenated window and the pre-activation (two copies of
            # the activation per convolution).  The halo is exchanged outside, so the
            # recomputation sends nothing.
            return checkpoint(self._local, x, halo, pos, use_reentrant=False)
        return self._local(x, halo, pos)

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

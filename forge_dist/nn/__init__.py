"""Sequence-parallel layers (docs/design.md sections 1 and 8) with FLA's parameter names.

Each layer takes ``group=`` (process group; ``None`` = ordinary single-device layer) and
``strategy=``; forward takes this rank's shard ``[B, T_local, hidden]`` and optional global
``cu_seqlens``.  See :mod:`forge_dist.nn.layers` and :mod:`forge_dist.nn.model`.
:func:`patch` (:mod:`forge_dist.nn.patching`) swaps the mixers of an FLA model for these;
:func:`graphed` (:mod:`forge_dist.nn.graphed`) captures a layer as CUDA graphs.
"""
from .conv import ShortConvolution
from .graphed import graphed
from .halo import halo_exchange
from .layers import (MIXERS, GatedDeltaNet, GatedLinearAttention, HGRNAttention,
                     LightningAttention, LinearAttention, Mamba2, MultiScaleRetention,
                     SimpleGatedLinearAttention)
from .model import ForgeLM, LMConfig, sum_gradients
from .norm import FusedRMSNormGated, RMSNorm, RMSNormGated
from .patching import FLA_LAYERS, patch
from .rotary import RotaryEmbedding

__all__ = ["ShortConvolution", "halo_exchange", "MIXERS", "GatedDeltaNet",
           "GatedLinearAttention", "HGRNAttention", "LightningAttention", "LinearAttention",
           "Mamba2", "MultiScaleRetention", "SimpleGatedLinearAttention", "ForgeLM", "LMConfig",
           "sum_gradients", "FLA_LAYERS", "patch", "FusedRMSNormGated", "RMSNorm", "RMSNormGated",
           "RotaryEmbedding", "graphed"]

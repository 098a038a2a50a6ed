"""When the layers run their fused Triton kernels (convolution, norms, gates, rotary).

The kernels of :mod:`forge_dist.kernels` (``short_conv``, ``gated_norm``, ``gates``,
``rotary``) run where the ops' kernels run: CUDA tensors, unless ``FORGE_DIST_KERNELS=torch``;
CPU tensors under ``TRITON_INTERPRET=1`` with ``FORGE_DIST_KERNELS=triton``.  Under
``torch.compile`` the layers keep their PyTorch formulas, which the compiler fuses itself (and
traces without graph breaks).
"""
from __future__ import annotations

import torch

from ..ops.attention import _use_kernels

_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def use_fused(device: torch.device) -> bool:
    """Whether a layer's per-token pieces on ``device`` run as the fused Triton kernels."""
    return not _compiling() and _use_kernels(device)

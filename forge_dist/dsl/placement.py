"""Where a variant's Triton code may run: one switch shared by the op front (:mod:`.api`) and
the lowering (:mod:`.lowering`), kept apart so neither imports the other for it."""
from __future__ import annotations

import os

import torch


def use_kernels(device: torch.device) -> bool:
    """Triton templates and generated code for CUDA tensors (``FORGE_DIST_KERNELS=torch``
    turns them off; ``FORGE_DIST_DSL_TRITON=1`` also allows CPU tensors under
    ``TRITON_INTERPRET=1``)."""
    choice = os.environ.get("FORGE_DIST_KERNELS", "auto")
    if choice == "torch":
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("FORGE_DIST_DSL_TRITON", "0") == "1" and \
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

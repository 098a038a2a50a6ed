"""Kernel tests run Triton under its CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is imported, so it is set here, for this folder,
when no CUDA device is visible.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

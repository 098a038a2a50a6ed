"""What the Triton backward tests share: the device they run on and the error measure."""
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def require_kernels() -> None:
    """Skip the calling test module unless the kernels can run (CUDA, or the interpreter)."""
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)


def rel(a, b) -> float:
    """Relative error ``|a - b| / |b|`` in fp64."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()

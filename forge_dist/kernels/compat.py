"""Triton availability, the interpreter's helpers and the small helpers of the kernel modules.

``HAVE_TRITON``, ``triton`` and ``tl`` (``None`` without Triton: callers fall back to
PyTorch); :func:`interpreting` and the fixes for Triton 3.6's interpreter (the numpy shim,
applied on import under ``TRITON_INTERPRET=1``, and the opt-in
:func:`interpreter_bf16_dot`); configs and tensors: :func:`next_pow2`, :func:`sized_config`,
:func:`dot_precision`, :func:`grad_like`, :func:`ensure`.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

try:  # Triton is optional: callers fall back to PyTorch when it is missing
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_numpy_shim() -> None:
    """Triton 3.6's interpreter turns loop bounds into 1-element arrays and calls ``int()`` on
    them, which numpy >= 2.4 refuses ("only 0-dimensional arrays ...").  Read the element
    instead.  Only touches the interpreter, only when it is in use."""
    try:
        from triton.runtime import interpreter as _it  # optional: the gpu extra
    except ImportError:  # pragma: no cover
        return
    orig = getattr(_it, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_forge_dist_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._forge_dist_shim = True
    _it._patch_lang_tensor = patched


if HAVE_TRITON and interpreting():
    _interpreter_numpy_shim()


def interpreter_bf16_dot(create_dot):
    """Triton 3.6's interpreter multiplies bf16 tensors as their raw uint16 bits; this wraps
    its ``InterpreterBuilder.create_dot`` so that bf16 operands are widened to fp32 first (the
    GPU needs nothing).  Opt-in, for the checks that run bf16 kernels on the CPU."""
    # optional: the gpu extra (and `import triton` does not load its interpreter)
    from triton.runtime import interpreter as it

    def create_dot_widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype == tl.bfloat16:
                return it.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                       tl.float32)
            return x
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot_widened.widens_bf16 = True
    return create_dot_widened


# Host-side integer helpers: Triton 3.6's triton.cdiv / next_power_of_2 are constexpr
# functions, several microseconds of argument unwrapping per host call.
def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def differentiated(*tensors: Optional[Tensor]) -> bool:
    """Whether a call on ``tensors`` must go through its ``autograd.Function``: autograd
    records it (a tensor requires grad) or forward-mode AD is on (where the Function
    raises rather than drop a tangent).  Otherwise the kernels launch without autograd's
    bookkeeping, which is host time."""
    if _forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def sized_config(base: dict, K: int) -> dict:
    """A pattern's walker config for head dim K: at K >= 256 halve the V tile and double
    the warps, so the ``[BK, BV]`` fp32 state tile stays in registers."""
    cfg = dict(base)
    if next_pow2(K) >= 256:
        cfg.update(BV=32, num_warps=8)
    return cfg


def env_tiles(name: str) -> dict:
    """Tile overrides for tuning runs from environment variable ``name``: comma-separated
    ``key=value`` pairs of ``BV`` (a power of two >= 16), ``num_warps`` (a power of two) or
    ``num_stages`` (a positive integer); ``{}`` when unset."""
    raw = os.environ.get(name, "").strip()
    tiles = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, value = item.partition("=")
        n = int(value) if value.isdigit() else 0
        if key not in ("BV", "num_warps", "num_stages") or n < 1 or (
                key != "num_stages" and (n & (n - 1) or key == "BV" and n < 16)):
            raise ValueError(f"{name}: expected BV= (a power of two >= 16), num_warps= (a "
                             f"power of two) or num_stages= (a positive integer), got {item!r}")
        tiles[key] = n
    return tiles


def dot_precision(dtype: torch.dtype, exact: bool = False) -> str:
    """``input_precision`` for fp32 operands: 3xTF32 (~fp32 accuracy on tensor cores).

    ``exact`` asks for IEEE fp32 FMA dots (used for the dense transition chain on request).
    bf16/fp16 operands ignore the setting.
    """
    if interpreting():
        return "ieee"
    return "ieee" if exact else "tf32x3"


def grad_like(grad: Optional[Tensor], ref: Optional[Tensor]) -> Optional[Tensor]:
    """``grad`` in ``ref``'s dtype (``None`` when either is ``None``): a Triton backward's
    fp32 gradient handed back for an input of another dtype."""
    return None if grad is None or ref is None else grad.to(ref.dtype)


def ensure(t: Optional[Tensor]) -> Optional[Tensor]:
    """Contiguous tensor (gates may arrive as expanded views, e.g. ``g_gamma``)."""
    return None if t is None else t.contiguous()

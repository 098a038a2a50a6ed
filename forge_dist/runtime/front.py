"""What a plan calls back into the public ops for, registered by :mod:`forge_dist.ops`.

The runtime sits below the ops (the ops' front plans its calls through
:mod:`.cache`), so it does not import them.  The one thing a plan still needs from that
layer, the PyTorch op behind a ``backend="torch"`` plan (CPU without Triton), is registered
here by op name when :mod:`forge_dist.ops` is imported (which importing
:mod:`forge_dist` always does).  (The cross-rank agreement a sequence-parallel plan runs
once lives below both, in :mod:`forge_dist.sp.agreement`.)
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping

_TORCH_OPS: Dict[str, Callable] = {}


def register(*, torch_ops: Mapping[str, Callable]) -> None:
    """``torch_ops``: op name -> the public op (FLA conventions)."""
    _TORCH_OPS.update(torch_ops)


def torch_op(name: str) -> Callable:
    """The public op registered as ``name``."""
    try:
        return _TORCH_OPS[name]
    except KeyError:
        raise RuntimeError(f"no PyTorch op registered for {name!r} (forge_dist.ops registers "
                           "them when imported)") from None

"""What a plan calls back into the public ops for, registered by :mod:`forge_dist.ops`.

The runtime sits below the ops (the ops' front plans its calls through
:mod:`.cache`), so it does not import them.  Two things a plan still needs from that
layer are registered here when :mod:`forge_dist.ops` is imported (which importing
:mod:`forge_dist` always does):

* the PyTorch op behind a ``backend="torch"`` plan (CPU without Triton), by op name;
* the cross-rank agreement check a sequence-parallel plan runs once, when it is made.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

_TORCH_OPS: Dict[str, Callable] = {}
_AGREE: Optional[Callable] = None


def register(*, torch_ops: Mapping[str, Callable], agree: Callable) -> None:
    """``torch_ops``: op name -> the public op (FLA conventions); ``agree(group, device,
    fields)``: raise on every rank of ``group`` unless all passed the same ``fields``
    (name -> value as the user wrote it: ints, dtypes, strategy and op names)."""
    global _AGREE
    _TORCH_OPS.update(torch_ops)
    _AGREE = agree


def torch_op(name: str) -> Callable:
    """The public op registered as ``name``."""
    try:
        return _TORCH_OPS[name]
    except KeyError:
        raise RuntimeError(f"no PyTorch op registered for {name!r} (forge_dist.ops registers "
                           "them when imported)") from None


def agree(group, device, fields: Dict[str, object]) -> None:
    """Run the registered cross-rank agreement check on ``fields``."""
    if _AGREE is None:
        raise RuntimeError("no cross-rank agreement check registered (forge_dist.ops "
                           "registers it when imported)")
    _AGREE(group, device, fields)

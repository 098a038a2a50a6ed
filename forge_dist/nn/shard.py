"""Where this rank's shard sits in the global (possibly packed) sequence."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..sp import p2p


def positions(T_local: int, group, cu_seqlens: Optional[Tensor], device) -> Tensor:
    """Position of every local token inside its own sequence, ``[T_local]`` int64.

    Rank r holds global tokens ``[r * T_local, (r + 1) * T_local)``.  Without ``cu_seqlens``
    the position is the global index; with it (global packed offsets, B=1) it counts from the
    start of the packed sequence the token belongs to, which may lie on an earlier rank.
    """
    rank, _ = p2p.rank_and_size(group)
    pos = torch.arange(rank * T_local, (rank + 1) * T_local, device=device)
    if cu_seqlens is None:
        return pos
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu, pos, right=True) - 1
    return pos - cu[seq]

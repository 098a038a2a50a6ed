"""Which node each rank of a group runs on, read from the launcher's environment.

:func:`nodes` gives the group's ranks by node (runs of consecutive ranks), which ``hier`` lays
its rounds out by and ``auto`` prices (:mod:`.choice`).  The layout never changes a result,
only which rounds cross nodes.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from . import p2p


def node_of_this_process(env=None) -> int:
    """This process's node: ``FORGE_DIST_NODE`` if set; else ``RANK //
    FORGE_DIST_RANKS_PER_NODE`` if that is set (nodes laid out by hand, or simulated on one
    machine); else the launcher's: torchrun's ``GROUP_RANK``, slurm's ``SLURM_NODEID``,
    ``RANK // LOCAL_WORLD_SIZE``; else 0."""
    env = os.environ if env is None else env

    def number(key: str) -> Optional[int]:
        text = env.get(key, "").strip()
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}: expected a whole number, got {env[key]!r}") from None
    node = number("FORGE_DIST_NODE")
    if node is not None:
        return node
    per_node, rank = number("FORGE_DIST_RANKS_PER_NODE"), number("RANK")
    if per_node is not None:
        if per_node < 1 or rank is None:
            raise ValueError(f"FORGE_DIST_RANKS_PER_NODE: expected a count >= 1 with RANK set, "
                             f"got {env['FORGE_DIST_RANKS_PER_NODE']!r} (RANK="
                             f"{env.get('RANK')!r})")
        return rank // per_node
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        node = number(key)
        if node is not None:
            return node
    local = number("LOCAL_WORLD_SIZE")
    if rank is not None and local:
        return rank // local
    return 0


def runs(node_ids: List[int]) -> List[List[int]]:
    """Group ranks in runs of consecutive ranks on one node (``[[0, 1], [2, 3]]``)."""
    out: List[List[int]] = []
    for r, node in enumerate(node_ids):
        if out and node_ids[out[-1][-1]] == node:
            out[-1].append(r)
        else:
            out.append([r])
    return out


_NODES: Dict[object, List[List[int]]] = {}
_PICKS: Dict[tuple, str] = {}


def nodes(group) -> List[List[int]]:
    """The group's ranks by node (:func:`runs` of every rank's
    :func:`node_of_this_process`); one all-gather per group, then cached."""
    key = getattr(group, "group_name", None) or id(group)
    if key not in _NODES:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the ranks' nodes are agreed by a collective on the first sequence-parallel "
                "call with strategy 'hier' or 'auto', which cannot run inside a CUDA graph "
                "capture; make one call eagerly (a warm-up step) on every rank before capturing")
        _NODES[key] = runs([int(n) for n in p2p.all_gather_object(
            node_of_this_process(), group, "the ranks' nodes (hier)")])
    return _NODES[key]


def cached(group, what: tuple, compute) -> str:
    """``compute(nodes(group))`` for ``what`` (e.g. auto's pick for one kind and state),
    kept with the group's layout (one model evaluation per group, layout and ``what``)."""
    key = (getattr(group, "group_name", None) or id(group),) + what
    if key not in _PICKS:
        _PICKS[key] = compute(nodes(group))
    return _PICKS[key]


def forget(group=None) -> None:
    """Drop the cached layout (of ``group``, or all) and what was computed from it."""
    if group is None:
        _NODES.clear()
        _PICKS.clear()
    else:
        name = getattr(group, "group_name", None) or id(group)
        _NODES.pop(name, None)
        for key in [k for k in _PICKS if k[0] == name]:
            del _PICKS[key]

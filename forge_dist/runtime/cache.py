"""A small LRU of plans keyed by their signature, for ops that call the same shapes again.

Usage (what ``forge_dist.ops`` does on its no-grad, single-device path,
:mod:`forge_dist.ops.planned`)::

    from forge_dist.runtime import cache
    p = cache.get("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=q.dtype, device=q.device,
                  gated=g is not None, initial_state=h0 is not None,
                  output_final_state=output_final_state, scale=scale, group=group,
                  strategy=strategy)
    o, final = p.run(q, k, v, g, initial_state=h0)

The key is every keyword of :func:`~forge_dist.runtime.plan.plan` (dtypes and devices by
value, a process group by identity), so a hit is exactly the plan that call would make.
Making a plan may allocate workspaces and, for forge, symmetric buffers (a collective):
every rank must make the same ``get`` calls in the same order, as for any collective.

A plan that runs inside a CUDA graph capture is :func:`pin`-ned: the graph's kernels keep its
workspaces' addresses, so the plan must outlive every replay.  A pinned plan is never
evicted or cleared; :func:`get` still finds it once the LRU has dropped it.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch

from .plan import Plan, plan

_LOCK = threading.Lock()
_PLANS: "OrderedDict[Tuple, Plan]" = OrderedDict()
_STATS = {"hits": 0, "misses": 0, "evictions": 0}
# (op, stream, keywords in the caller's order with raw values) -> key(): the normalised,
# sorted key costs tens of microseconds per call, and a call site passes its keywords in
# the same order every time.  Unhashable values (a tiles dict) skip it.
_INDEX: Dict[Tuple, Tuple] = {}
# key -> plan, for plans a CUDA graph captured: never dropped (see the module docstring)
_PINNED: Dict[Tuple, Plan] = {}


def maxsize() -> int:
    """Capacity (``FORGE_DIST_PLAN_CACHE_SIZE``, default 64)."""
    return int(os.environ.get("FORGE_DIST_PLAN_CACHE_SIZE", "64"))


def _norm(v: Any):
    if isinstance(v, torch.device):
        return ("device", str(v))
    if isinstance(v, torch.dtype):
        return ("dtype", str(v))
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (tuple, list)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, (int, float, str, bool, type(None))):
        return v
    return ("id", id(v))  # process groups, dispatchers: by identity


def key(op: str, **kw) -> Tuple:
    """The cache key of a :func:`plan` call."""
    if "device" in kw and kw["device"] is not None:
        kw["device"] = torch.device(kw["device"])
    return (op,) + tuple(sorted((k, _norm(v)) for k, v in kw.items()))


def get(op: str, stream: int = 0, thread: int = 0, **kw) -> Plan:
    """The cached plan for this signature, planning it on a miss (LRU eviction).

    ``stream`` (a raw CUDA stream handle) and ``thread`` (a thread id), part of the key only,
    keep calls on different streams or threads on different plans: a plan's workspaces and
    launch parameter buffers are reused by every run, so two streams or threads running one
    plan at the same time would race on them."""
    try:
        raw: Any = (op, stream, thread, tuple(kw.items()))
        k = _INDEX.get(raw)
    except TypeError:
        raw = k = None
    if k is None:
        k = key(op, **kw) + (("stream", int(stream)), ("thread", int(thread)))
        if raw is not None:
            with _LOCK:
                if len(_INDEX) >= 4 * max(1, maxsize()):
                    _INDEX.clear()
                _INDEX[raw] = k
    p = lookup(k)
    if p is not None:
        return p
    p = plan(op, **kw)
    p.cache_key = k
    with _LOCK:
        _STATS["misses"] += 1
        _PLANS[k] = p
        _PLANS.move_to_end(k)
        while len(_PLANS) > max(1, maxsize()):
            _PLANS.popitem(last=False)
            _STATS["evictions"] += 1
    return p


def lookup(k: Tuple):
    """The cached plan of key ``k`` (a plan's ``cache_key``), or ``None`` once evicted
    (unless pinned)."""
    with _LOCK:
        p = _PLANS.get(k)
        if p is not None:
            _PLANS.move_to_end(k)
            _STATS["hits"] += 1
            return p
        p = _PINNED.get(k)
        if p is not None:
            _STATS["hits"] += 1
        return p


def pin(p: Plan) -> None:
    """Keep cached plan ``p`` for the life of the process (a CUDA graph captured its
    launches, so its workspaces must stay where they are)."""
    k = getattr(p, "cache_key", None)
    if k is None:
        raise ValueError("pin: expected a plan from this cache (it has no cache_key)")
    with _LOCK:
        _PINNED[k] = p


def pinned() -> Tuple[Plan, ...]:
    with _LOCK:
        return tuple(_PINNED.values())


def clear() -> None:
    """Drop every cached plan but the pinned ones."""
    with _LOCK:
        _PLANS.clear()
        _INDEX.clear()
        for k in _STATS:
            _STATS[k] = 0


def stats() -> Dict[str, int]:
    with _LOCK:
        return dict(_STATS, size=len(_PLANS))

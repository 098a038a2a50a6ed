"""A small LRU of plans keyed by their signature, for ops that call the same shapes again.

Usage (what ``forge_dist.ops`` does on its no-grad, single-device path,
:mod:`forge_dist.ops.planned`)::

    from forge_dist.runtime import cache
    p = cache.get("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=q.dtype, device=q.device,
                  gated=g is not None, initial_state=h0 is not None,
                  output_final_state=output_final_state, scale=scale, group=group,
                  strategy=strategy)
    o, final = p.run(q, k, v, g, initial_state=h0)

The key is every keyword of :func:`~forge_dist.runtime.planner.plan` (dtypes and devices by
value, a process group by identity), so a hit is exactly the plan that call would make.
Making a plan may allocate workspaces and, for forge, symmetric buffers (a collective):
every rank must make the same ``get`` calls in the same order, as for any collective.

Calls inside a CUDA graph capture get plans of their own (``get(..., captured=True)``):
the graph keeps a plan's workspace addresses, and its replays run on whatever stream is
current then, so such a plan must outlive every replay and must never serve an eager call
(a later stream can get the capture stream's handle back from PyTorch's pool).  Captured
plans are kept apart from the LRU: never evicted, dropped only by :func:`release_captured`,
and never returned to a call outside a capture.  Graphs captured on one stream with the same
call signatures share those plans' workspaces: replay them in order, on one stream.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch

from .plan import Plan
from .planner import plan

_LOCK = threading.Lock()
_PLANS: "OrderedDict[Tuple, Plan]" = OrderedDict()
_STATS = {"hits": 0, "misses": 0, "evictions": 0}
# (op, stream, keywords in the caller's order with raw values) -> key(): the normalised,
# sorted key costs tens of microseconds per call, and a call site passes its keywords in
# the same order every time.  Unhashable values (a tiles dict) skip it.
_INDEX: Dict[Tuple, Tuple] = {}
# key -> plan, for calls inside CUDA graph captures (see the module docstring); their keys
# end in CAPTURED
_CAPTURED: Dict[Tuple, Plan] = {}
CAPTURED = ("captured", True)


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


def get(op: str, stream: int = 0, thread: int = 0, captured: bool = False, **kw) -> Plan:
    """The cached plan for this signature, planning it on a miss (LRU eviction).

    ``stream`` (a raw CUDA stream handle) and ``thread`` (a thread id), part of the key only,
    keep calls on different streams or threads on different plans: a plan's workspaces and
    launch parameter buffers are reused by every run, so two streams or threads running one
    plan at the same time would race on them.  ``captured``: the call is inside a CUDA graph
    capture; its plan comes from the captured plans (module docstring), not the LRU."""
    try:
        raw: Any = (op, stream, thread, captured, tuple(kw.items()))
        k = _INDEX.get(raw)
    except TypeError:
        raw = k = None
    if k is None:
        k = key(op, **kw) + (("stream", int(stream)), ("thread", int(thread)))
        if captured:
            k += (CAPTURED,)
        if raw is not None:
            with _LOCK:
                if len(_INDEX) >= 4 * max(1, maxsize()):
                    _INDEX.clear()
                _INDEX[raw] = k
    if captured:
        with _LOCK:
            p = _CAPTURED.get(k)
        if p is None:
            p = plan(op, **kw)
            p.cache_key = k
            with _LOCK:
                p = _CAPTURED.setdefault(k, p)
        return p
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
    """The cached plan of key ``k`` (a plan's ``cache_key``), or ``None`` once evicted."""
    with _LOCK:
        p = _PLANS.get(k)
        if p is not None:
            _PLANS.move_to_end(k)
            _STATS["hits"] += 1
        return p


def captured_plans() -> Tuple[Plan, ...]:
    """The plans of calls made inside CUDA graph captures (module docstring)."""
    with _LOCK:
        return tuple(_CAPTURED.values())


def release_captured() -> int:
    """Drop the captured plans (returns how many).  Only once every graph that captured a
    call of the ops is gone: a replay afterwards would write freed memory."""
    with _LOCK:
        n = len(_CAPTURED)
        _CAPTURED.clear()
        return n


def clear() -> None:
    """Drop every cached plan (not the captured ones: :func:`release_captured`)."""
    with _LOCK:
        _PLANS.clear()
        _INDEX.clear()
        for k in _STATS:
            _STATS[k] = 0


def stats() -> Dict[str, int]:
    with _LOCK:
        return dict(_STATS, size=len(_PLANS))

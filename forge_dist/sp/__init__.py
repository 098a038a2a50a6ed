"""Sequence-parallel strategies for the inter-rank phase (DESIGN.md section 3).

Importing this package registers ``serial``, ``pipelined`` and ``lasp2``; the GPU-initiated
``forge`` strategy registers itself from :mod:`forge_dist.sp.forge` when present.
"""
from . import lasp2, pipelined, serial  # noqa: F401  (registration)
from .base import Strategy, names, register, resolve, state_pass
from .p2p import StatePassTimeout

__all__ = ["Strategy", "StatePassTimeout", "names", "register", "resolve", "state_pass"]

"""The variants the package ships, each registered once with its static facts.

Every layer reads this table instead of keeping its own list of op names: the ops front
(:mod:`forge_dist.ops`), the kernels (:mod:`forge_dist.kernels` picks the pattern's module
by :attr:`~.base.VariantSpec.pattern`), the plans and the AOT step
(:mod:`forge_dist.runtime`).  A new op on an existing computational pattern is one
:func:`register` call (plus its public function in :mod:`forge_dist.ops`).
"""
from __future__ import annotations

from typing import Dict, Tuple

from .base import VariantSpec
from .transitions import Kind

_REGISTRY: Dict[str, VariantSpec] = {}


def register(spec: VariantSpec) -> VariantSpec:
    """Add ``spec`` under its name (again with the same spec: no-op) and return it."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"variant {spec.name!r} is registered already as {known}")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> Tuple[str, ...]:
    """Registered variant names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> VariantSpec:
    """The spec registered as ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known: {names()}") from None


def find(name: str):
    """The spec registered as ``name``, or ``None``."""
    return _REGISTRY.get(name)


LINEAR_ATTN = register(VariantSpec("linear_attn", Kind.IDENTITY, pattern="scalar_decay",
                                   inputs=("q", "k", "v")))
SIMPLE_GLA = register(VariantSpec("simple_gla", Kind.SCALAR, pattern="scalar_decay",
                                  inputs=("q", "k", "v", "g"), gate="head",
                                  gate_optional=True))
GLA = register(VariantSpec("gla", Kind.DIAGONAL, pattern="vector_decay",
                           inputs=("q", "k", "v", "g"), gate="channel"))
GATED_DELTA_RULE = register(VariantSpec("gated_delta_rule", Kind.DENSE, pattern="delta_rule",
                                        inputs=("q", "k", "v", "g", "beta"), gate="head",
                                        gate_optional=True))
HGRN = register(VariantSpec("hgrn", Kind.DIAGONAL, vector_state=True, pattern="vector_state",
                            inputs=("x", "g"), gate="feature"))

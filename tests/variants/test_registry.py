"""The variant registry: every layer reads it, and a new op on an existing pattern is one
registration (its kernels, programs and plans follow from the pattern)."""
import pytest
import torch

from forge_dist import kernels, ops
from forge_dist.runtime import aot, sp_setup
from forge_dist.variants import registry
from forge_dist.variants.base import VariantSpec
from forge_dist.variants.transitions import Kind


def test_every_registered_variant_has_its_op_and_kernels():
    for name in registry.names():
        spec = registry.get(name)
        assert callable(getattr(ops, name)), name
        assert spec.pattern in kernels.PATTERNS, name
        assert spec.inputs[:3] in (("q", "k", "v"), ("x", "g")), name
        assert (spec.gate is None) == ("g" not in spec.inputs), name
    assert kernels.variants() == registry.names()
    assert aot.DEFAULTS["variants"] == list(registry.names())
    assert sp_setup.sp_variants() == ("linear_attn", "simple_gla", "gla", "gated_delta_rule",
                                      "hgrn")
    with pytest.raises(KeyError, match="unknown variant 'softmax'"):
        registry.get("softmax")


def test_registering_the_same_name_twice_must_agree():
    assert registry.register(registry.get("gla")) is registry.get("gla")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(VariantSpec("gla", Kind.SCALAR))


def test_a_new_op_on_an_existing_pattern_is_one_registration(monkeypatch):
    """A retention-like op registered on the scalar-decay pattern: the kernels accept it,
    and its forward and backward programs are simple_gla's (the same launches)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(VariantSpec("retention_like", Kind.SCALAR, pattern="scalar_decay",
                                  inputs=("q", "k", "v", "g"), gate="head"))
    assert "retention_like" in kernels.variants()
    assert kernels.mappable("retention_like") == ("q", "k", "v", "g")
    dims = dict(B=1, T=128, H=2, K=32, V=32, dtype=torch.bfloat16, has_h0=True, gated=True)
    new = kernels.forward_program("retention_like", **dims)
    old = kernels.forward_program("simple_gla", **dims)
    assert [s.key for s in new.specs()] == [s.key for s in old.specs()]
    new = kernels.backward_program("retention_like", has_dht=True, **dims)
    old = kernels.backward_program("simple_gla", has_dht=True, **dims)
    assert [s.key for s in new.specs()] == [s.key for s in old.specs()]
    # its gate is required (not gate_optional): a program without one is refused
    with pytest.raises(ValueError, match="retention_like needs its gate g"):
        kernels.forward_program("retention_like", **dict(dims, gated=False))
    q = torch.zeros(1, 8, 2, 32)
    assert kernels.supported("retention_like", {"q": q, "k": q, "v": q}) in (
        "retention_like expects g [B, T, H]", "triton is not installed")

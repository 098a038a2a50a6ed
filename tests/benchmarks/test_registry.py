"""scaling_benchmarks/registry.py: every registered op is a public op that takes the
registered arguments in that order, and make_inputs gives the documented shapes."""
import inspect
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from scaling_benchmarks import registry  # noqa: E402

from forge_dist import ops  # noqa: E402

SHAPE = registry.Shape(B=2, H=3, K=8, V=4, D=6)


def _inputs(op, T=16):
    gen = torch.Generator().manual_seed(0)
    return registry.make_inputs(op, SHAPE, T, dtype=torch.float64,
                                randn=lambda *s: torch.randn(*s, generator=gen,
                                                             dtype=torch.float64),
                                rand=lambda *s: torch.rand(*s, generator=gen,
                                                           dtype=torch.float64))


@pytest.mark.parametrize("op", registry.NAMES)
def test_registered_args_are_the_ops_positional_parameters(op):
    params = [p.name for p in inspect.signature(getattr(ops, op)).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(params[:len(registry.spec(op).args)]) == registry.spec(op).args


@pytest.mark.parametrize("op", registry.NAMES)
def test_inputs_have_the_documented_shapes_and_run(op):
    inp = _inputs(op)
    B, T, H, K, V = SHAPE.B, 16, SHAPE.H, SHAPE.K, SHAPE.V
    want = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, H, V), "beta": (B, T, H),
            "x": (B, T, SHAPE.D)}
    gate = {"head": (B, T, H), "channel": (B, T, H, K), "feature": (B, T, SHAPE.D)}
    assert set(inp) == set(registry.spec(op).args)
    for name, t in inp.items():
        assert tuple(t.shape) == (gate[registry.spec(op).gate] if name == "g" else want[name])
    if "g" in inp:
        assert (inp["g"] <= 0).all()  # log decays
    if registry.spec(op).normalize_k:
        torch.testing.assert_close(inp["k"].norm(dim=-1), torch.ones(B, T, H, dtype=torch.float64))
    o = getattr(ops, op)(*registry.call_args(op, inp))[0]
    assert o.shape == inp[registry.spec(op).first].shape[:3] + (
        () if registry.spec(op).vector_state else (V,))
    assert torch.isfinite(o).all()


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="'retnet2'.*linear_attn"):
        registry.spec("retnet2")

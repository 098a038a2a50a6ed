"""GPU: every layer captured as CUDA graphs (forge_dist.nn.graphed) equals the same layer
called eagerly: outputs, the input's gradient and every parameter's, over replays with new
inputs."""
import copy

import pytest
import torch

from forge_dist import nn as fnn

pytestmark = pytest.mark.gpu

HIDDEN = 1024
LAYERS = {  # FLA's configs at hidden 1024 (scaling_benchmarks/layers.py)
    "GatedDeltaNet": dict(head_dim=128, num_heads=6, expand_v=2),
    "GatedLinearAttention": dict(num_heads=4, expand_k=0.5, expand_v=1.0),
    "MultiScaleRetention": dict(num_heads=8, expand_k=1.0, expand_v=2.0),
    "SimpleGatedLinearAttention": dict(num_heads=4, expand_k=1.0, expand_v=1.0),
    "HGRNAttention": dict(expand_ratio=1),
    "LinearAttention": dict(num_heads=8, expand_k=1.0, expand_v=1.0),
    "Mamba2": dict(num_heads=32, head_dim=64, state_size=128, expand=2, n_groups=1,
                   use_conv_bias=True, use_bias=False),
    "LightningAttention": dict(num_heads=8, num_layers=4),
}


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_graphed_layer_equals_the_eager_layer(name):
    torch.manual_seed(0)
    layer = getattr(fnn, name)(hidden_size=HIDDEN, layer_idx=1, **LAYERS[name])
    layer = layer.cuda().to(torch.bfloat16)
    eager = copy.deepcopy(layer)
    B, T = 2, 1024
    sample = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = fnn.graphed(layer, sample)
    for seed in (1, 2):  # replays with new inputs
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x0 = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        up = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        for m in (layer, eager):
            m.zero_grad(set_to_none=True)
        x, xe = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        o = step(x)
        o.backward(up)
        oe = eager(xe)[0]
        oe.backward(up)
        assert rel(o, oe) < 1e-2 and rel(x.grad, xe.grad) < 1e-2
        for (n, p), pe in zip(layer.named_parameters(), eager.parameters()):
            if pe.grad is not None:
                assert rel(p.grad, pe.grad) < 2e-2, n
    with pytest.raises(ValueError, match="must match the captured sample"):
        step(torch.randn(B, T // 2, HIDDEN, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True))
    with pytest.raises(ValueError, match="must match the captured sample"):
        step(torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16))  # no grad


@pytest.mark.parametrize("name", ["GatedDeltaNet", "HGRNAttention", "Mamba2"])
def test_a_layer_captured_under_no_grad_replays_its_forward(name):
    torch.manual_seed(0)
    layer = getattr(fnn, name)(hidden_size=HIDDEN, layer_idx=1, **LAYERS[name])
    layer = layer.cuda().to(torch.bfloat16).eval()
    B, T = 2, 1024
    with torch.no_grad():
        step = fnn.graphed(layer, torch.randn(B, T, HIDDEN, device="cuda",
                                              dtype=torch.bfloat16))
        for seed in (1, 2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            assert rel(step(x).clone(), layer(x)[0]) < 1e-2

"""FLA state dicts load into the forge_dist layers (same key names and shapes).

The expected keys and shapes below were printed from ``flash-linear-attention==0.6.0``'s
layers built with the same arguments (``{k: tuple(v.shape) for k, v in
layer.state_dict().items()}``); that package is not a test dependency, so they are kept here.
"""
import pytest
import torch

from forge_dist import nn as fnn

FLA_060 = {
    "GatedLinearAttention": (
        lambda: fnn.GatedLinearAttention(hidden_size=32, num_heads=2),
        {"q_proj.weight": (16, 32), "k_proj.weight": (16, 32), "v_proj.weight": (32, 32),
         "g_proj.weight": (32, 32), "gk_proj.0.weight": (16, 32), "gk_proj.1.weight": (16, 16),
         "gk_proj.1.bias": (16,), "o_proj.weight": (32, 32), "g_norm_swish_gate.weight": (16,)}),
    "GatedDeltaNet": (
        lambda: fnn.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2),
        {"A_log": (2,), "dt_bias": (2,), "q_proj.weight": (16, 32), "k_proj.weight": (16, 32),
         "v_proj.weight": (32, 32), "a_proj.weight": (2, 32), "b_proj.weight": (2, 32),
         "q_conv1d.weight": (16, 1, 4), "k_conv1d.weight": (16, 1, 4),
         "v_conv1d.weight": (32, 1, 4), "g_proj.weight": (32, 32), "o_norm.weight": (16,),
         "o_proj.weight": (32, 32)}),
    "HGRNAttention": (
        lambda: fnn.HGRNAttention(hidden_size=32),
        {"i_proj.weight": (32, 32), "f_proj.weight": (32, 32), "g_proj.weight": (32, 32),
         "g_norm.weight": (32,), "o_proj.weight": (32, 32)}),
    "MultiScaleRetention": (
        lambda: fnn.MultiScaleRetention(hidden_size=32, num_heads=2),
        {"q_proj.weight": (32, 32), "k_proj.weight": (32, 32), "v_proj.weight": (64, 32),
         "g_proj.weight": (64, 32), "o_proj.weight": (32, 64),
         "g_norm_swish_gate.weight": (32,)}),
    "Mamba2": (
        lambda: fnn.Mamba2(hidden_size=32, head_dim=8, state_size=8),
        {"dt_bias": (8,), "A_log": (8,), "D": (8,), "conv1d.weight": (80, 1, 4),
         "conv1d.bias": (80,), "in_proj.weight": (152, 32), "norm.weight": (64,),
         "out_proj.weight": (32, 64)}),
    "LinearAttention": (
        lambda: fnn.LinearAttention(hidden_size=32, num_heads=2),
        {"feature_map_q.layer1.weight": (16, 16), "feature_map_q.layer1.bias": (16,),
         "feature_map_q.layer2.weight": (16, 16), "feature_map_q.layer2.bias": (16,),
         "feature_map_k.layer1.weight": (16, 16), "feature_map_k.layer1.bias": (16,),
         "feature_map_k.layer2.weight": (16, 16), "feature_map_k.layer2.bias": (16,),
         "q_proj.weight": (32, 32), "k_proj.weight": (32, 32), "v_proj.weight": (32, 32),
         "norm.weight": (16,), "o_proj.weight": (32, 32)}),
    "SimpleGatedLinearAttention": (
        lambda: fnn.SimpleGatedLinearAttention(hidden_size=32, num_heads=2),
        {"q_proj.weight": (32, 32), "k_proj.weight": (32, 32), "v_proj.weight": (32, 32),
         "g_proj.weight": (32, 32), "q_conv1d.weight": (32, 1, 4),
         "k_conv1d.weight": (32, 1, 4), "v_conv1d.weight": (32, 1, 4),
         "gk_proj.weight": (2, 32), "gk_proj.bias": (2,), "g_norm_swish_gate.weight": (16,),
         "o_proj.weight": (32, 32)}),
}


@pytest.mark.parametrize("name", list(FLA_060))
def test_fla_state_dict_loads(name):
    make, fla_shapes = FLA_060[name]
    layer = make().double()
    ours = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert ours == fla_shapes
    gen = torch.Generator().manual_seed(0)
    fla_sd = {k: 0.3 * torch.randn(s, generator=gen, dtype=torch.float64)
              for k, s in fla_shapes.items()}
    x = torch.randn(1, 12, 32, generator=gen, dtype=torch.float64)
    before = layer(x)[0]
    layer.load_state_dict(fla_sd, strict=True)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, fla_sd[k]), k
    after = layer(x)[0]
    assert torch.isfinite(after).all() and not torch.allclose(before, after)

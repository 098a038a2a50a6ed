"""forge_dist.nn.graphed on the CPU: what it refuses (the captures themselves are GPU tests,
tests/nn/test_graphed_gpu.py)."""
import pytest
import torch

from forge_dist import nn as fnn


def test_a_cpu_sample_is_refused_by_name():
    layer = fnn.GatedLinearAttention(hidden_size=64, num_heads=2)
    with pytest.raises(ValueError, match="graphed: sample must be a CUDA tensor, got cpu"):
        fnn.graphed(layer, torch.randn(1, 16, 64))
    with pytest.raises(ValueError, match="got list"):
        fnn.graphed(layer, [1, 2])

"""Small layer configurations and shared utilities for the forge_dist.nn tests."""
from __future__ import annotations

import torch
import torch.distributed as dist

from forge_dist import nn as fnn

HIDDEN = 16

#: name -> constructor of a small layer exercising the family's full path (convs, gates, norms)
FACTORIES = {
    "linear_attn": lambda **kw: fnn.LinearAttention(hidden_size=HIDDEN, num_heads=2, **kw),
    "retnet": lambda **kw: fnn.MultiScaleRetention(hidden_size=HIDDEN, num_heads=2,
                                                   use_short_conv=True, **kw),
    "lightning": lambda **kw: fnn.LightningAttention(hidden_size=HIDDEN, num_heads=2,
                                                     layer_idx=1, num_layers=3, **kw),
    "simple_gla": lambda **kw: fnn.SimpleGatedLinearAttention(hidden_size=HIDDEN, num_heads=2,
                                                              **kw),
    "mamba2": lambda **kw: fnn.Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, n_groups=2,
                                      **kw),
    "gla": lambda **kw: fnn.GatedLinearAttention(hidden_size=HIDDEN, num_heads=2,
                                                 num_kv_heads=1, use_short_conv=True,
                                                 gate_low_rank_dim=4, **kw),
    "hgrn": lambda **kw: fnn.HGRNAttention(hidden_size=HIDDEN, use_short_conv=True, **kw),
    "gdn": lambda **kw: fnn.GatedDeltaNet(hidden_size=HIDDEN, head_dim=4, num_heads=2,
                                          num_v_heads=4, expand_v=1.5, **kw),
}


def make_layer(name: str, dtype: torch.dtype, seed: int = 0, **kw) -> torch.nn.Module:
    """A seeded layer whose every parameter is perturbed away from its init (so norms with
    weight 1 and zero biases are tested as general parameters)."""
    torch.manual_seed(seed)
    layer = FACTORIES[name](**kw).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return layer


def stand_in(cls_name: str, ours: torch.nn.Module) -> torch.nn.Module:
    """A module of class name ``cls_name`` (not our class) with ``ours``'s attributes,
    parameters and forward, standing in for the FLA layer of that name."""
    ours_cls = type(ours)
    stand_cls = type(cls_name, (torch.nn.Module,), {"forward": ours_cls.forward,
                                                    "__module__": "fla.layers.fake"})
    for attr in dir(ours_cls):  # helper methods and class attributes the forward uses
        if not attr.startswith("__") and not hasattr(stand_cls, attr):
            setattr(stand_cls, attr, getattr(ours_cls, attr))
    m = stand_cls.__new__(stand_cls)
    m.__dict__.update(ours.__dict__)
    return m


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``[B, T_local, ...]`` shard along dim 1."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def sum_ranks(x: torch.Tensor, group) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y

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


def fla_model_configs(hidden: int, vocab: int, small: bool = False) -> dict:
    """name -> ``(FLA model class, config)`` of a two-layer FLA model of every patchable
    layer type (skips the test without FLA's model package); ``small``: the head sizes of
    the CPU test (FLA's kernels through Triton's interpreter)."""
    import pytest
    M = pytest.importorskip("fla.models")
    common = dict(hidden_size=hidden, num_hidden_layers=2, vocab_size=vocab)
    hd = 32 if small else 64
    return {
        "gdn": (M.GatedDeltaNetForCausalLM,
                M.GatedDeltaNetConfig(head_dim=hd, num_heads=2 if small else 6, expand_v=2,
                                      **common)),
        "gla": (M.GLAForCausalLM, M.GLAConfig(num_heads=2 if small else 4, **common)),
        "gla_conv_gqa": (M.GLAForCausalLM, M.GLAConfig(num_heads=4, num_kv_heads=2,
                                                       use_short_conv=True, **common)),
        "hgrn": (M.HGRNForCausalLM, M.HGRNConfig(**common)),
        "hgrn_conv": (M.HGRNForCausalLM, M.HGRNConfig(use_short_conv=True, **common)),
        "retnet": (M.RetNetForCausalLM, M.RetNetConfig(num_heads=2 if small else 4, **common)),
        # n_groups=1: FLA's PyTorch fallback (used without mamba_ssm) tiles the B/C groups
        # over the heads in its prefill but interleaves them in its decoding step
        "mamba2": (M.Mamba2ForCausalLM,
                   M.Mamba2Config(head_dim=hd, num_heads=8 if small else 16,
                                  state_size=16 if small else 64, n_groups=1, **common)),
        "linear_attn": (M.LinearAttentionForCausalLM,
                        M.LinearAttentionConfig(num_heads=2 if small else 4, **common)),
    }


def fla_cache_states(cache) -> dict:
    """``{(layer, kind, i): tensor}`` of an FLA cache: recurrent states, convolution tails."""
    out = {}
    for layer, state in enumerate(cache):
        out[(layer, "recurrent", 0)] = state["recurrent_state"]
        convs = state["conv_state"]
        if convs is not None:
            for i, c in enumerate(convs if isinstance(convs, (tuple, list)) else (convs,)):
                out[(layer, "conv", i)] = c
    return out


def sp_prefill_then_decode(ref, patched, ids: torch.Tensor, group, steps: int) -> list:
    """``[logit error, cache error, tokens differ]`` of one rank: ``patched`` (its layers
    on ``group``) prefills this rank's equal share of ``ids [B, T]`` against ``ref`` (FLA's
    model) on all of it, then both decode ``steps`` greedy tokens from their caches (the
    patched one from the cache gathered to every rank, starting from the last rank's
    token).  Call under ``torch.no_grad()``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    TL = ids.shape[1] // size
    full = ref(input_ids=ids)
    out = patched(input_ids=ids[:, rank * TL:(rank + 1) * TL])
    logit_err = rel_err(out.logits, full.logits[:, rank * TL:(rank + 1) * TL])
    sa, sb = fla_cache_states(full.past_key_values), fla_cache_states(out.past_key_values)
    cache_err = max(rel_err(sb[k].float(), sa[k].float()) for k in sa)

    def greedy(model, cache, first):  # FLA's caches update in place: compared above first
        toks = [first]
        for _ in range(steps - 1):
            step = model(input_ids=toks[-1], past_key_values=cache)
            cache = step.past_key_values
            toks.append(step.logits[:, -1:].argmax(-1))
        return torch.cat(toks, 1)

    want = greedy(ref, full.past_key_values, full.logits[:, -1:].argmax(-1))
    last = out.logits[:, -1:].argmax(-1)
    dist.broadcast(last, src=size - 1, group=group)  # the last token's logits: last rank
    got = greedy(patched, out.past_key_values, last)
    return [logit_err, cache_err, float(not torch.equal(got, want))]


def first_config_run(self, *args, **kwargs):
    """``triton.runtime.autotuner.Autotuner.run`` that takes the first configuration: the
    same math, compiled once and never timed (a CPU cannot time, and a fresh GPU machine
    would spend minutes compiling every configuration of FLA's kernels)."""
    self.best_config = self.configs[0]
    bound = dict(zip(self.arg_names, args))
    extra = {k: v for k, v in {**kwargs, **self.best_config.all_kwargs()}.items()
             if k not in bound}
    return self.fn.run(*args, **extra)

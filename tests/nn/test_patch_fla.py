"""``forge_dist.nn.patch`` on FLA-like models, on the CPU: the call as documented, every
hyper-parameter carried over, FLA's block call convention and FLA's cache.

FLA's models build their layers from their configs (``norm_eps=1e-6`` where the layers'
default is ``1e-5``, for one) and FLA's layers keep some arguments only inside submodules
(the norm's ``eps``); a patch that misses one changes the model's output silently.  The
stand-ins here are our layers built with non-default values under FLA's class names (FLA
itself is not a test dependency); the last test builds FLA's own layers when FLA's
``flash-linear-attention`` package is importable.
"""
import pytest
import torch
from torch import nn

import forge_dist.nn
from forge_dist import nn as fnn
from forge_dist.nn.patching import FLA_LAYERS, check_same_config, layer_kwargs

from .helpers import rel_err, stand_in

F64 = torch.float64
HIDDEN = 16

#: FLA class name -> constructors of our layer with values other than the defaults
NON_DEFAULT = {
    "GatedDeltaNet": [
        lambda: fnn.GatedDeltaNet(hidden_size=HIDDEN, head_dim=4, num_heads=2, num_v_heads=4,
                                  expand_v=1.5, norm_eps=1e-6, layer_idx=0),
        lambda: fnn.GatedDeltaNet(hidden_size=HIDDEN, head_dim=4, num_heads=2, norm_eps=1e-3,
                                  output_gate_activation="sigmoid", allow_neg_eigval=True,
                                  conv_size=3, layer_idx=0),
        lambda: fnn.GatedDeltaNet(hidden_size=HIDDEN, head_dim=4, num_heads=2, use_gate=False,
                                  norm_eps=1e-6, layer_idx=0)],
    "GatedLinearAttention": [
        lambda: fnn.GatedLinearAttention(hidden_size=HIDDEN, num_heads=2, num_kv_heads=1,
                                         use_short_conv=True, norm_eps=1e-6, clamp_min=-2.0,
                                         gate_logit_normalizer=8, gate_low_rank_dim=4,
                                         layer_idx=0),
        lambda: fnn.GatedLinearAttention(hidden_size=HIDDEN, num_heads=2, fuse_norm=False,
                                         feature_map="relu", elementwise_affine=False,
                                         norm_eps=1e-3, layer_idx=0),
        lambda: fnn.GatedLinearAttention(hidden_size=HIDDEN, num_heads=2, gate_fn="sigmoid",
                                         expand_k=0.75, norm_eps=1e-6, layer_idx=0)],
    "HGRNAttention": [
        lambda: fnn.HGRNAttention(hidden_size=HIDDEN, use_short_conv=True, norm_eps=1e-6,
                                  layer_idx=0),
        lambda: fnn.HGRNAttention(hidden_size=HIDDEN, expand_ratio=2, elementwise_affine=False,
                                  norm_eps=1e-3, layer_idx=0)],
    "MultiScaleRetention": [
        lambda: fnn.MultiScaleRetention(hidden_size=HIDDEN, num_heads=2, norm_eps=1e-6,
                                        use_short_conv=True, layer_idx=0),
        lambda: fnn.MultiScaleRetention(hidden_size=HIDDEN, num_heads=2, use_output_gate=False,
                                        feature_map="silu", norm_eps=1e-3, layer_idx=0)],
    "SimpleGatedLinearAttention": [
        lambda: fnn.SimpleGatedLinearAttention(hidden_size=HIDDEN, num_heads=2, norm_eps=1e-6,
                                               gate_logit_normalizer=4, layer_idx=0)],
    "LinearAttention": [
        lambda: fnn.LinearAttention(hidden_size=HIDDEN, num_heads=2, norm_eps=1e-6,
                                    tie_feature_map_qk=True, layer_idx=0),
        lambda: fnn.LinearAttention(hidden_size=HIDDEN, num_heads=2, feature_map="relu",
                                    norm_q=True, norm_k=True, norm_eps=1e-3, layer_idx=0),
        lambda: fnn.LinearAttention(hidden_size=HIDDEN, num_heads=2, feature_map="elu",
                                    output_norm="identity", layer_idx=0)],
    "Mamba2": [
        lambda: fnn.Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, n_groups=2,
                           norm_eps=1e-6, layer_idx=0),
        lambda: fnn.Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, D_has_hdim=True,
                           norm_before_gate=True, dt_limit=(0.01, 0.5), use_bias=True,
                           conv_kernel=3, norm_eps=1e-3, layer_idx=0),
        lambda: fnn.Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, rmsnorm=False,
                           use_conv_bias=False, layer_idx=0)],
}
CASES = [(name, i) for name, makers in NON_DEFAULT.items() for i in range(len(makers))]


def _perturbed(layer: nn.Module, seed: int, small: bool) -> nn.Module:
    """Random parameters; ``small`` scales the value path down (FLA's init gives outputs of
    mean square ~1e-5 before the output norm, where its ``eps`` decides the result)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=F64))
            if small and name.split(".")[0] in ("v_proj", "i_proj", "in_proj"):
                p.mul_(1e-3)
    return layer


def _fla_model(name: str, i: int, seed: int = 0):
    """A two-block model of stand-ins (FLA's class name, our forward and attributes)."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList()
    for j in range(2):
        blk = nn.Module()
        ours = _perturbed(NON_DEFAULT[name][i]().double(), seed + j, small=j == 0)
        ours.layer_idx = j
        blk.attn = stand_in(name, ours)
        model.layers.append(blk)
    return model


def test_patch_is_the_function():
    """The README's ``forge_dist.nn.patch(model, group=...)``."""
    assert callable(forge_dist.nn.patch)
    model = _fla_model("GatedDeltaNet", 0)
    assert forge_dist.nn.patch(model, group=None) == ["layers.0.attn", "layers.1.attn"]


@pytest.mark.parametrize("name,i", CASES)
def test_patch_keeps_every_hyper_parameter_and_the_output(name, i):
    model = _fla_model(name, i)
    x = torch.randn(2, 12, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(5))
    before = [blk.attn(x)[0] for blk in model.layers]
    fla_layers = [blk.attn for blk in model.layers]
    fnn.patch(model, strategy="serial")
    for blk, fla, ref in zip(model.layers, fla_layers, before):
        assert isinstance(blk.attn, FLA_LAYERS[name])
        fla_attrs = {k: v for k, v in vars(fla).items() if isinstance(v, (bool, int, float, str))}
        new_attrs = {k: getattr(blk.attn, k) for k in fla_attrs if k != "strategy"}
        assert new_attrs == {k: v for k, v in fla_attrs.items() if k != "strategy"}
        for (path, sub), (_, new_sub) in zip(fla.named_modules(), blk.attn.named_modules()):
            if hasattr(sub, "eps"):
                assert new_sub.eps == sub.eps, path
        assert rel_err(blk.attn(x)[0], ref) < 1e-12


def test_patch_refuses_a_layer_it_would_build_differently():
    """The configuration check: an attribute the constructor cannot express raises, and
    nothing is replaced."""
    model = _fla_model("GatedLinearAttention", 0)
    first = model.layers[0].attn
    model.layers[1].attn.g_norm_swish_gate.eps = 0.25
    model.layers[1].attn.g_norm_swish_gate.activation = "sigmoid"  # not a constructor option
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.g_norm_swish_gate\.activation: "
                                         r"FLA's layer has 'sigmoid'"):
        fnn.patch(model)
    assert model.layers[0].attn is first
    new = FLA_LAYERS["GatedLinearAttention"](**layer_kwargs("GatedLinearAttention",
                                                             model.layers[0].attn))
    new.gate_logit_normalizer = 3
    with pytest.raises(ValueError, match=r"gate_logit_normalizer: FLA's layer has 8"):
        check_same_config("x", model.layers[0].attn, new)


# ---------------------------------------------------------------- FLA's block call convention
class _FLABlock(nn.Module):
    """The call FLA's blocks make (``fla/models/*/modeling_*.py``)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        hidden_states, attentions, past_key_values = self.attn(
            hidden_states=x, attention_mask=attention_mask, past_key_values=past_key_values,
            use_cache=use_cache, output_attentions=False, **kwargs)
        return x + hidden_states, attentions, past_key_values


class FakeCache:
    """FLA's ``Cache`` protocol (``fla.models.cache_utils``) without transformers: one
    state dict and token count per layer."""

    def __init__(self):
        self.states, self.seen = [], []

    def __len__(self):
        return len(self.states)

    def __getitem__(self, layer_idx):
        return self.states[layer_idx]

    def get_seq_length(self, layer_idx=0):
        return self.seen[layer_idx] if layer_idx < len(self.seen) else 0

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None,
               layer_idx=0, offset=1, cache_kwargs=None):
        while len(self.states) <= layer_idx:
            self.states.append(dict(recurrent_state=None, attn_state=None, conv_state=None,
                                    ffn_state=None))
            self.seen.append(0)
        state = self.states[layer_idx]
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if conv_state is not None:
            state["conv_state"] = conv_state
        self.seen[layer_idx] += offset
        return state


#: FLA's cached recurrent-state shape per layer, for B=2 (``state_v_first`` layouts)
FLA_STATE_SHAPES = {
    "GatedDeltaNet": (2, 4, 6, 4), "GatedLinearAttention": (2, 2, 8, 4),
    "HGRNAttention": (2, 16), "MultiScaleRetention": (2, 2, 8, 16),
    "SimpleGatedLinearAttention": (2, 2, 8, 8), "LinearAttention": (2, 2, 8, 8),
    "Mamba2": (2, 4, 8, 4),
}


@pytest.mark.parametrize("name", list(NON_DEFAULT))
def test_block_call_convention_and_cache(name):
    """An FLA block's call with an all-ones mask, ``use_cache`` and extra kwargs; the
    prefill's cache continues token by token to the full sequence's outputs."""
    layer = _perturbed(NON_DEFAULT[name][0]().double(), 1, small=False)
    block = _FLABlock(layer)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 11, HIDDEN, dtype=F64, generator=gen)
    full, attn, pkv = block(x, attention_mask=torch.ones(2, 11, dtype=torch.long),
                            use_cache=False, unknown_kwarg=1)
    assert attn is None and pkv is None

    cache = FakeCache()
    out, attn, pkv = block(x[:, :7], attention_mask=torch.ones(2, 7), past_key_values=cache,
                           use_cache=True)
    assert pkv is cache and cache.get_seq_length(0) == 7
    state = cache[0]
    assert tuple(state["recurrent_state"].shape) == FLA_STATE_SHAPES[name]
    convs = state["conv_state"]
    if getattr(layer, "use_short_conv", name == "Mamba2"):
        convs = convs if isinstance(convs, tuple) else (convs,)
        W = layer.conv1d.kernel_size[0] if name == "Mamba2" else layer.conv_size
        assert all(c.shape[0] == 2 and c.shape[2] == W for c in convs)
    else:
        assert convs is None
    outs = [out]
    for t in range(7, 11):
        out, _, _ = block(x[:, t:t + 1], attention_mask=torch.ones(2, t + 1),
                          past_key_values=cache, use_cache=True)
        outs.append(out)
    assert cache.get_seq_length(0) == 11
    assert rel_err(torch.cat(outs, 1), full) < 1e-10

    with pytest.raises(NotImplementedError, match="attention_mask with padding"):
        block(x, attention_mask=torch.tensor([[0] + [1] * 10] * 2))


@pytest.mark.parametrize("name", ["GatedDeltaNet", "Mamba2", "LinearAttention"])
def test_cache_continues_a_multi_token_step(name):
    """A continuation of several tokens (a chunked prefill) equals the whole sequence."""
    layer = _perturbed(NON_DEFAULT[name][0]().double(), 3, small=False)
    x = torch.randn(1, 9, HIDDEN, dtype=F64, generator=torch.Generator().manual_seed(4))
    full = layer(x)[0]
    cache = FakeCache()
    a = layer(x[:, :2], past_key_values=cache, use_cache=True)[0]
    b = layer(x[:, 2:9], past_key_values=cache, use_cache=True)[0]
    assert rel_err(torch.cat([a, b], 1), full) < 1e-10


# ------------------------------------------------------------------- FLA's own layers
FLA_BUILDS = {
    "GatedDeltaNet": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4,
                          expand_v=1.5, norm_eps=1e-6, output_gate_activation="sigmoid",
                          allow_neg_eigval=True, conv_size=3, layer_idx=1),
    "GatedLinearAttention": dict(hidden_size=32, num_heads=2, num_kv_heads=1, expand_k=0.75,
                                 use_short_conv=True, fuse_norm=False, feature_map="relu",
                                 gate_fn="sigmoid", norm_eps=1e-6, clamp_min=-3.0,
                                 gate_logit_normalizer=8, gate_low_rank_dim=4, layer_idx=1),
    "HGRNAttention": dict(hidden_size=32, expand_ratio=2, use_short_conv=True,
                          elementwise_affine=False, norm_eps=1e-6, layer_idx=1),
    "MultiScaleRetention": dict(hidden_size=32, num_heads=2, feature_map="silu",
                                use_output_gate=False, norm_eps=1e-6, layer_idx=1),
    "SimpleGatedLinearAttention": dict(hidden_size=32, num_heads=2, norm_eps=1e-6,
                                       gate_logit_normalizer=4, layer_idx=1),
    "LinearAttention": dict(hidden_size=32, num_heads=2, tie_feature_map_qk=True,
                            norm_q=True, norm_eps=1e-6, layer_idx=1),
    "Mamba2": dict(hidden_size=32, head_dim=8, state_size=4, n_groups=2, D_has_hdim=True,
                   norm_before_gate=True, dt_limit=(0.01, 0.5), use_bias=True,
                   conv_kernel=3, norm_eps=1e-6, layer_idx=1),
}


@pytest.mark.parametrize("name", list(FLA_BUILDS))
def test_patch_reads_fla_layers(name):
    """FLA's own layer classes (constructed on the CPU; skipped without FLA's package)."""
    fla_layers = pytest.importorskip("fla.layers")
    kw = FLA_BUILDS[name]
    pytest.importorskip("fla.layers.simple_gla")
    cls = getattr(fla_layers, name, None) or getattr(fla_layers.simple_gla, name)
    fla = cls(**kw)
    built = layer_kwargs(name, fla)
    for k, v in kw.items():
        assert built.get(k, v) == v, (k, built.get(k), v)
    assert built["norm_eps"] == 1e-6
    model = nn.Module()
    model.attn = fla
    sd = fla.state_dict()
    fnn.patch(model)  # runs check_same_config
    assert isinstance(model.attn, FLA_LAYERS[name])
    assert all(torch.equal(model.attn.state_dict()[k], v) for k, v in sd.items())


# ------------------------------------------------------ sequence-parallel prefill, then decode
#: (layer, tokens per rank): 3 is shorter than the convolution's window of 4
SP_CASES = [("GatedDeltaNet", 3), ("MultiScaleRetention", 6), ("Mamba2", 6)]


def _sp_prefill(group):
    """Each of 2 ranks prefills its shard with ``group``; the cache every rank gets must
    equal one process's, and decoding from it must continue the full sequence (the rotary
    offset counts the global tokens)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    errs = []
    for name, T_local in SP_CASES:
        torch.manual_seed(0)  # the same layer on every rank
        layer = _perturbed(NON_DEFAULT[name][0]().double(), 7, small=False)
        x = torch.randn(2, 2 * T_local + 3, HIDDEN, dtype=F64,
                        generator=torch.Generator().manual_seed(8))
        full = layer(x)[0]
        one = FakeCache()
        layer(x[:, :2 * T_local], past_key_values=one, use_cache=True)
        cache = FakeCache()
        shard = x[:, rank * T_local:(rank + 1) * T_local]
        out = layer(shard, past_key_values=cache, use_cache=True, group=group)[0]
        errs.append(rel_err(out, full[:, rank * T_local:(rank + 1) * T_local]))
        assert cache.get_seq_length(0) == 2 * T_local
        a, b = one[0], cache[0]
        errs.append(rel_err(b["recurrent_state"], a["recurrent_state"]))
        convs_a, convs_b = a["conv_state"], b["conv_state"]
        if convs_a is not None:
            for ca, cb in zip(*(c if isinstance(c, tuple) else (c,)
                                for c in (convs_a, convs_b))):
                errs.append(rel_err(cb, ca))
        outs = [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True, group=group)[0]
                for t in range(2 * T_local, x.shape[1])]
        errs.append(rel_err(torch.cat(outs, 1), full[:, 2 * T_local:]))
    worst = torch.tensor(max(errs), dtype=F64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()


def test_sequence_parallel_prefill_gathers_the_cache_to_every_rank():
    from tests.sp.distributed import run_world

    assert run_world(2, _sp_prefill) < 1e-10

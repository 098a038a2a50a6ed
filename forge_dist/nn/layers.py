"""Sequence-parallel token mixers with FLA's parameter names (FLA state dicts load as is).

Every layer takes ``hidden_states [B, T_local, hidden_size]`` (this rank's contiguous shard of
the global sequence) and FLA's block arguments (``attention_mask, past_key_values, use_cache,
output_attentions, **kwargs``) and returns FLA's triple ``(o [B, T_local, hidden_size], None,
past_key_values)``, so it drops into an FLA block.  ``group`` (constructor or forward keyword)
is the sequence-parallel process group; ``None`` makes an ordinary single-device layer.
``cu_seqlens`` (forward keyword) holds the *global* packed offsets with ``B == 1``; packed
sequences may straddle ranks.  Projections, gates and norms are per token; the only
cross-rank pieces are the recurrence (``forge_dist.ops``, differentiable across ranks) and the
short convolution's halo (:mod:`forge_dist.nn.halo`).

The ops' Triton kernels read contiguous ``[B, T, H, D]`` tensors (anything else is copied
once on the way in: :func:`forge_dist.kernels.compat.ensure`, and ``_plan_ready`` in
:mod:`forge_dist.ops.planned` for cached plans).  The layers
hand them contiguous tensors without copies: every projection is its own GEMM, and the fused
short convolution, gate, rotary and norm kernels (on CUDA) read strided views and write
contiguous outputs.

FLA's cache works as in FLA (:mod:`forge_dist.nn.cache`): a prefill, also sequence-parallel,
fills ``past_key_values`` with FLA's entries (recurrent state and convolution tails, on every
rank), and later calls continue from it.  Unsupported FLA options (padding masks with zeros,
caches with ``cu_seqlens``, feature maps with their own learned kernels other than
``elementwise_product``) raise instead of being ignored.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..kernels.gates import gdn_gates, hgrn_gates, logsigmoid_gate
from ..ops import custom_ops
from ..sp import p2p
from .cache import CacheCall
from .fused import use_fused
from .conv import ShortConvolution
from .norm import FusedRMSNormGated, RMSNorm, RMSNormGated
from .rotary import RotaryEmbedding
from .shard import positions

_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

_UNSET = object()
_FEATURE_MAPS = {None: None, "identity": lambda x: x, "relu": F.relu, "silu": F.silu,
                 "swish": F.silu, "sigmoid": torch.sigmoid, "elu": lambda x: F.elu(x) + 1.0}


def _wide(x: Tensor) -> torch.dtype:
    """fp32 for gates (fp64 for fp64 models): decays must not be rounded to bf16."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _heads(x: Tensor, d: int) -> Tensor:
    """``[B, T, H*d]`` -> ``[B, T, H, d]``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // d, d)


def _flat(x: Tensor) -> Tensor:
    """``[B, T, H, d]`` -> ``[B, T, H*d]``."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _logsigmoid_gate(x: Tensor, normalizer: float, clamp_min: Optional[float] = None) -> Tensor:
    """``max(logsigmoid(x) / normalizer, clamp_min)`` in fp32 (fp64 for fp64): one fused
    kernel where the Triton kernels run, else PyTorch ops."""
    if use_fused(x.device):
        return logsigmoid_gate(x, normalizer, clamp_min)
    g = F.logsigmoid(x.to(_wide(x))) / normalizer
    return g if clamp_min is None else torch.clamp_min(g, clamp_min)


def _feature_map(name):
    if name not in _FEATURE_MAPS:
        raise NotImplementedError(f"feature_map: {name!r} is not supported; use one of "
                                  f"{[k for k in _FEATURE_MAPS if k is not None]} or None")
    return _FEATURE_MAPS[name]


class SPMixin(nn.Module):
    """Holds the default process group and strategy; checks FLA's inference-only kwargs."""

    #: ``True``/``False``: call the ``torch.library`` custom ops of
    #: :mod:`forge_dist.ops.custom_ops` (for ``torch.compile``) or the eager ops; ``None``
    #: (default) follows :func:`forge_dist.ops.custom_ops.enable`.
    use_custom_ops: Optional[bool] = None

    def _op(self, name: str):
        use = custom_ops.enabled() if self.use_custom_ops is None else self.use_custom_ops
        return getattr(custom_ops if use else ops, name)

    def _sp_init(self, group, strategy: str):
        self.group = group
        self.strategy = strategy

    #: FLA caches this layer's recurrent state as ``[N, H, V, K]`` (its ``state_v_first``)
    state_v_first: bool = False
    #: FLA caches this layer's one convolution state as a tensor, not a tuple (Mamba2)
    single_conv_state: bool = False

    def _begin(self, x: Tensor, group, attention_mask, past_key_values, use_cache, cu_seqlens
               ) -> CacheCall:
        """Checks FLA's block arguments; returns the call's cache bookkeeping, whose
        ``group`` is the one to use (``None`` when continuing a cache)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("attention_mask with padding (zeros) is not supported: "
                                      "pack sequences and pass cu_seqlens instead")
        group = self.group if group is _UNSET else group
        return CacheCall(self, past_key_values, use_cache, group, cu_seqlens, x.shape[1])

    def _op_kwargs(self, cu_seqlens, group):
        return dict(cu_seqlens=cu_seqlens, group=group, strategy=self.strategy)


class _QKVConv(nn.Module):
    """q/k/v projections and optional short convolutions shared by the attention-like layers."""

    def _make_qkv(self, hidden_size, use_short_conv, conv_size, conv_bias):
        """q, k, v projections (k and v per KV group), then their short convolutions
        (FLA's creation order, so seeded initialisations match)."""
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        self._make_convs(use_short_conv, conv_size, conv_bias,
                         (self.key_dim, self.key_dim_per_group, self.value_dim_per_group))

    def _make_convs(self, use_short_conv, conv_size, conv_bias, dims, activation="silu"):
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        if use_short_conv:
            self.q_conv1d = ShortConvolution(dims[0], conv_size, conv_bias, activation)
            self.k_conv1d = ShortConvolution(dims[1], conv_size, conv_bias, activation)
            self.v_conv1d = ShortConvolution(dims[2], conv_size, conv_bias, activation)

    def _qkv(self, x, call: CacheCall):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q, k, v = call.convs((self.q_conv1d, q), (self.k_conv1d, k), (self.v_conv1d, v))
        return q, k, v


class _GatedOutput(nn.Module):
    """FLA's output path: per-head (gated) RMSNorm, optional output gate, ``o_proj``."""

    def _make_output(self, use_output_gate, gate_fn, fuse_norm, elementwise_affine, norm_eps):
        self.use_output_gate = use_output_gate
        if use_output_gate:
            self.g_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.fuse_norm_and_gate = gate_fn == "swish" and fuse_norm and use_output_gate
        if self.fuse_norm_and_gate:
            self.g_norm_swish_gate = FusedRMSNormGated(self.head_v_dim, elementwise_affine,
                                                       norm_eps)
        else:
            self.g_norm = RMSNorm(self.head_v_dim, elementwise_affine, eps=norm_eps)
            self.gate_fn = _feature_map(gate_fn)
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """``o [B, T, H, Dv]``, ``x [B, T, hidden]`` -> ``[B, T, hidden]``."""
        if self.use_output_gate:
            g = self.g_proj(x)
            if self.fuse_norm_and_gate:
                o = _flat(self.g_norm_swish_gate(o, _heads(g, self.head_v_dim)))
            else:
                o = _flat(self.g_norm(o)) * self.gate_fn(g)
        else:
            o = _flat(self.g_norm(o))
        return self.o_proj(o.to(x.dtype))


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """FLA's ``'(h d) -> (h g) d'`` repeat: each kv head serves ``groups`` query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def _kv_dims(self, hidden_size, expand_k, expand_v, num_heads, num_kv_heads):
    self.hidden_size, self.num_heads = hidden_size, num_heads
    self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    self.num_kv_groups = num_heads // self.num_kv_heads
    # round as FLA does: hidden * (key_dim / hidden) may land just below an integer
    self.key_dim, self.value_dim = round(hidden_size * expand_k), round(hidden_size * expand_v)
    if self.key_dim % num_heads or self.value_dim % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide key_dim={self.key_dim} and "
                         f"value_dim={self.value_dim}")
    self.key_dim_per_group = self.key_dim // self.num_kv_groups
    self.value_dim_per_group = self.value_dim // self.num_kv_groups
    self.head_k_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads


# --------------------------------------------------------------------------- linear attention
class HadamardFeatureMap(nn.Module):
    """FLA's ``elementwise_product`` feature map: ``layer1(x) * layer2(x)`` per head."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.layer1 = nn.Linear(head_dim, head_dim)
        self.layer2 = nn.Linear(head_dim, head_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer1(x) * self.layer2(x)


class LinearAttention(SPMixin):
    """``fla.layers.LinearAttention``: ``S_t = S_{t-1} + phi(k_t) v_t^T`` (no decay).

    Parameters: ``q_proj, k_proj, v_proj, [feature_map_q, feature_map_k], norm, o_proj``.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 8, num_kv_heads: Optional[int] = None,
                 feature_map: str = "elementwise_product", tie_feature_map_qk: bool = False,
                 output_norm: str = "rmsnorm", norm_q: bool = False, norm_k: bool = False,
                 do_feature_map_norm: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None, *, group=None,
                 strategy: str = "auto", **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        _kv_dims(self, hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        self.mode, self.layer_idx = mode, layer_idx
        if do_feature_map_norm:
            raise NotImplementedError("do_feature_map_norm (normalised linear attention) is "
                                      "not supported")
        if feature_map == "elementwise_product":
            self.feature_map_q = HadamardFeatureMap(self.head_k_dim)
            self.feature_map_k = (self.feature_map_q if tie_feature_map_qk
                                  else HadamardFeatureMap(self.head_k_dim))
        else:
            fm = _feature_map(feature_map)
            self.feature_map_q = self.feature_map_k = fm if fm is not None else (lambda x: x)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        if output_norm == "rmsnorm":
            self.norm = RMSNorm(self.head_v_dim, elementwise_affine, eps=norm_eps)
        elif output_norm == "identity":
            self.norm = nn.Identity()
        else:
            raise NotImplementedError(f"output_norm: {output_norm!r} is not supported")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.norm_q, self.norm_k = norm_q, norm_k

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        q = _heads(self.q_proj(x), self.head_k_dim)
        k = _repeat_kv(_heads(self.k_proj(x), self.head_k_dim), self.num_kv_groups)
        v = _repeat_kv(_heads(self.v_proj(x), self.head_v_dim), self.num_kv_groups)
        q, k = self.feature_map_q(q), self.feature_map_k(k)
        if self.norm_q:
            q = q / (q.sum(-1, True) + 1e-4)
        if self.norm_k:
            k = k / (k.sum(-1, True) + 1e-4)
        o = call.op("linear_attn", q, k, v, **self._op_kwargs(cu_seqlens, group))
        o = _flat(self.norm(o))
        return self.o_proj(o.to(x.dtype)), None, call.finish()


# ----------------------------------------------------------- constant scalar decay (RetNet)
class MultiScaleRetention(SPMixin, _QKVConv, _GatedOutput):
    """``fla.layers.MultiScaleRetention`` (RetNet): rotary q/k, fixed per-head decays.

    ``S_t = gamma_h S_{t-1} + k_t v_t^T`` with ``log gamma_h = log(1 - 2^(-5-h))``.
    Parameters: ``q_proj, k_proj, v_proj, [g_proj], [q/k/v_conv1d], o_proj`` and
    ``g_norm_swish_gate`` (or ``g_norm``).  ``decay="lightning"`` with ``num_layers`` gives
    Lightning Attention's slopes instead (see :class:`LightningAttention`).
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 2.0, num_heads: int = 8, num_kv_heads: Optional[int] = None,
                 feature_map: Optional[str] = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, fuse_norm: bool = True,
                 layer_idx: Optional[int] = None, *, decay: str = "retnet",
                 num_layers: Optional[int] = None, use_rotary: bool = True, group=None,
                 strategy: str = "auto", **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        _kv_dims(self, hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        self.mode, self.layer_idx = mode, layer_idx
        self.feature_map_fn = _feature_map(feature_map)
        if decay not in ("retnet", "lightning"):
            raise ValueError(f"decay: expected 'retnet' or 'lightning', got {decay!r}")
        if decay == "lightning" and (num_layers is None or layer_idx is None):
            raise ValueError("decay='lightning' needs layer_idx and num_layers")
        self.decay, self.num_layers = decay, num_layers
        self._make_qkv(hidden_size, use_short_conv, conv_size, conv_bias)
        self._make_output(use_output_gate, gate_fn, fuse_norm, elementwise_affine, norm_eps)
        self.rotary = RotaryEmbedding(self.head_k_dim) if use_rotary else None

    def log_decays(self, device) -> Tensor:
        """Per-head log decays ``[H]`` (fp32): constants of the layer's hyper-parameters,
        computed once per device in eager calls (no small kernels per call)."""
        if _compiling():  # traced: the compiler folds the constants itself
            return self._decays(device)
        # (a tensor made under inference_mode cannot be saved for a later backward)
        key = (torch.device(device), self.decay, self.num_heads, self.layer_idx,
               self.num_layers, torch.is_inference_mode_enabled())
        cached = self.__dict__.get("_log_decays")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_log_decays"] = (key, self._decays(device))
        return cached[1]

    def _decays(self, device) -> Tensor:
        H = self.num_heads
        if self.decay == "retnet":
            return ops.retnet_decays(H, device=device)
        slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)
        depth = 1.0 - self.layer_idx / max(self.num_layers - 1, 1) + 1e-5
        return (-slopes * depth).to(torch.float32).to(device)

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        q, k, v = self._qkv(x, call)
        q, k = _heads(q, self.head_k_dim), _heads(k, self.head_k_dim)
        if self.feature_map_fn is not None:
            q, k = self.feature_map_fn(q), self.feature_map_fn(k)
        if self.rotary is not None:
            if cu_seqlens is None:  # global positions from the shard's first: in the kernel
                first = p2p.rank_and_size(group)[0] * x.shape[1] + call.offset
                q, k = self.rotary(q, k, pos0=first)
            else:
                q, k = self.rotary(q, k, positions(x.shape[1], group, cu_seqlens, x.device)
                                   + call.offset)
        k = _repeat_kv(k, self.num_kv_groups)
        v = _repeat_kv(_heads(v, self.head_v_dim), self.num_kv_groups)
        o = call.op("simple_gla", q, k, v, g_gamma=self.log_decays(x.device),
                    **self._op_kwargs(cu_seqlens, group))
        return self._output(o, x), None, call.finish()


class LightningAttention(MultiScaleRetention):
    """Lightning Attention (TransNormerLLM / MiniMax style): constant per-head decays
    ``-2^(-8(h+1)/H) * (1 - layer_idx/(num_layers-1) + 1e-5)``, no rotary, silu feature map.
    Same parameter names as :class:`MultiScaleRetention`.
    """

    def __init__(self, hidden_size: int = 1024, num_heads: int = 8, *, layer_idx: int,
                 num_layers: int, expand_k: float = 1.0, expand_v: float = 1.0,
                 feature_map: Optional[str] = "silu", **kwargs):
        super().__init__(hidden_size=hidden_size, num_heads=num_heads, expand_k=expand_k,
                         expand_v=expand_v, feature_map=feature_map, layer_idx=layer_idx,
                         decay="lightning", num_layers=num_layers,
                         use_rotary=kwargs.pop("use_rotary", False), **kwargs)


# ------------------------------------------------- data-dependent scalar decay (Simple GLA)
class SimpleGatedLinearAttention(SPMixin, _QKVConv, _GatedOutput):
    """``fla.layers.SimpleGatedLinearAttention``: head-wise data-dependent decay
    ``g_t = logsigmoid(gk_proj(x_t)) / gate_logit_normalizer``, ``[B, T, H]``.
    """

    state_v_first = True

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 feature_map: Optional[str] = None, use_short_conv: bool = True,
                 conv_size: int = 4, conv_bias: bool = False, gate_fn: str = "swish",
                 elementwise_affine: bool = True, norm_eps: float = 1e-5,
                 gate_logit_normalizer: int = 16, fuse_norm: bool = True,
                 layer_idx: Optional[int] = None, *, group=None, strategy: str = "auto",
                 **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        _kv_dims(self, hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        self.mode, self.layer_idx = mode, layer_idx
        self.feature_map_fn = _feature_map(feature_map)
        self._make_qkv(hidden_size, use_short_conv, conv_size, conv_bias)
        self.gk_proj = nn.Linear(hidden_size, num_heads)
        self._make_output(True, gate_fn, fuse_norm, elementwise_affine, norm_eps)
        self.gate_logit_normalizer = gate_logit_normalizer

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        q, k, v = self._qkv(x, call)
        if self.feature_map_fn is not None:
            q, k = self.feature_map_fn(q), self.feature_map_fn(k)
        q = _heads(q, self.head_k_dim)
        k = _repeat_kv(_heads(k, self.head_k_dim), self.num_kv_groups)
        v = _repeat_kv(_heads(v, self.head_v_dim), self.num_kv_groups)
        gk = _logsigmoid_gate(self.gk_proj(x), self.gate_logit_normalizer)
        o = call.op("simple_gla", q, k, v, g=gk, **self._op_kwargs(cu_seqlens, group))
        return self._output(o, x), None, call.finish()


# ------------------------------------------------------------------------------- Mamba2 SSD
class Mamba2(SPMixin):
    """``fla.layers.Mamba2``: SSD with data-dependent scalar decay ``g = A * dt``.

    Parameters: ``in_proj`` (-> gate z, conv input xBC, dt), ``conv1d`` (depthwise causal conv
    over xBC, with bias), ``dt_bias, A_log, D, norm`` (gated group RMSNorm), ``out_proj``.
    FLA caches its SSM state as ``[N, H, P, N_state]`` and one convolution state.
    """

    state_v_first = True
    single_conv_state = True

    def __init__(self, num_heads: Optional[int] = None, head_dim: int = 64,
                 hidden_size: int = 2048, state_size: int = 128, expand: int = 2,
                 n_groups: int = 1, conv_kernel: int = 4, conv_init: Optional[float] = None,
                 use_conv_bias: bool = True, hidden_act: str = "silu",
                 A_init_range: Tuple[float, float] = (1, 16), D_has_hdim: bool = False,
                 rmsnorm: bool = True, norm_before_gate: bool = False, dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_limit: Tuple[float, float] = (0.0, float("inf")), use_bias: bool = False,
                 norm_eps: float = 1e-5, chunk_size: int = 256,
                 layer_idx: Optional[int] = None, *, group=None, strategy: str = "auto",
                 **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        self.hidden_size, self.expand, self.head_dim = hidden_size, expand, head_dim
        self.intermediate_size = int(expand * hidden_size)
        self.ssm_state_size, self.n_groups = state_size, n_groups
        if self.intermediate_size % head_dim:
            raise ValueError(f"expand * hidden_size ({self.intermediate_size}) must be "
                             f"divisible by head_dim ({head_dim})")
        inferred = self.intermediate_size // head_dim
        if num_heads not in (None, 0, inferred):
            raise ValueError(f"num_heads * head_dim ({num_heads * head_dim}) must equal "
                             f"expand * hidden_size ({self.intermediate_size})")
        self.num_heads = inferred
        if self.num_heads % n_groups:
            raise ValueError(f"n_groups={n_groups} must divide num_heads={self.num_heads}")
        if hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act: only 'silu' is supported, got {hidden_act!r}")
        self.conv_kernel_size, self.use_conv_bias = conv_kernel, use_conv_bias
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit, self.layer_idx, self.chunk_size = tuple(dt_limit), layer_idx, chunk_size
        self.use_bias = use_bias
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv1d = ShortConvolution(self.conv_dim, conv_kernel, use_conv_bias, "silu")
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.in_proj = nn.Linear(hidden_size,
                                 self.intermediate_size + self.conv_dim + self.num_heads,
                                 bias=use_bias)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.dt_bias._no_weight_decay = True
        A = torch.empty(self.num_heads, dtype=torch.float32).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.norm = (RMSNormGated(self.intermediate_size, eps=norm_eps,
                                  group_size=self.intermediate_size // n_groups,
                                  norm_before_gate=norm_before_gate) if rmsnorm else None)
        self.D = nn.Parameter(torch.ones(self.intermediate_size if D_has_hdim else self.num_heads))
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        b, T, _ = x.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
        I = self.intermediate_size
        gate, xBC, dt = self.in_proj(x).split([I, self.conv_dim, H], dim=-1)
        xBC = call.conv(self.conv1d, xBC)
        xs, Bm, Cm = xBC.split([I, G * N, G * N], dim=-1)
        wide = _wide(x)
        dt = F.softplus(dt.to(wide) + self.dt_bias.to(wide))
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.to(wide))
        D = None if self.D_has_hdim else self.D
        y = call.op("mamba2_ssd", xs.reshape(b, T, H, P), dt, A, Bm.reshape(b, T, G, N),
                    Cm.reshape(b, T, G, N), D, **self._op_kwargs(cu_seqlens, group))
        y = y.reshape(b, T, I)
        if self.D_has_hdim:
            y = y + xs * self.D.to(xs.dtype)
        if self.rmsnorm:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate)
        return self.out_proj(y.to(x.dtype)), None, call.finish()


# ------------------------------------------------------------------------ vector decay (GLA)
class GatedLinearAttention(SPMixin, _QKVConv, _GatedOutput):
    """``fla.layers.GatedLinearAttention``: ``S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T``,
    ``gk = logsigmoid(gk_proj(x)) / gate_logit_normalizer`` through a low-rank projection.
    """

    state_v_first = True

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: Optional[int] = None,
                 feature_map: Optional[str] = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16,
                 gate_low_rank_dim: int = 16, clamp_min: Optional[float] = None,
                 fuse_norm: bool = True, layer_idx: Optional[int] = None, *, group=None,
                 strategy: str = "auto", **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        _kv_dims(self, hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        self.mode, self.layer_idx, self.clamp_min = mode, layer_idx, clamp_min
        self.feature_map_fn = _feature_map(feature_map)
        self._make_qkv(hidden_size, use_short_conv, conv_size, conv_bias)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim_per_group))
        self._make_output(use_output_gate, gate_fn, fuse_norm, elementwise_affine, norm_eps)
        self.gate_logit_normalizer = gate_logit_normalizer

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        q, k, v = self._qkv(x, call)
        gk = self.gk_proj(x)
        q = _heads(q, self.head_k_dim)
        k = _repeat_kv(_heads(k, self.head_k_dim), self.num_kv_groups)
        gk = _logsigmoid_gate(gk, self.gate_logit_normalizer, self.clamp_min)
        gk = _repeat_kv(_heads(gk, self.head_k_dim), self.num_kv_groups)
        v = _repeat_kv(_heads(v, self.head_v_dim), self.num_kv_groups)
        if self.feature_map_fn is not None:
            q, k = self.feature_map_fn(q), self.feature_map_fn(k)
        o = call.op("gla", q, k, v, gk, **self._op_kwargs(cu_seqlens, group))
        return self._output(o, x), None, call.finish()


# ------------------------------------------------------------------------------------- HGRN
class HGRNAttention(SPMixin):
    """``fla.layers.HGRNAttention``: ``h_t = f_t * h_{t-1} + (1 - f_t) * silu(i_t)``.

    Parameters: ``i_proj, f_proj, g_proj, [i_conv1d, f_conv1d], g_norm, o_proj``.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024,
                 expand_ratio: Optional[int] = 1, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, layer_idx: Optional[int] = None, *, group=None,
                 strategy: str = "auto", **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        self.mode, self.hidden_size, self.expand_ratio = mode, hidden_size, expand_ratio
        self.input_dim = int(hidden_size * expand_ratio)
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.layer_idx = layer_idx
        self.i_proj = nn.Linear(hidden_size, self.input_dim, bias=False)
        self.f_proj = nn.Linear(hidden_size, self.input_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.input_dim, bias=False)
        if use_short_conv:
            self.f_conv1d = ShortConvolution(self.input_dim, conv_size, conv_bias, None)
            self.i_conv1d = ShortConvolution(self.input_dim, conv_size, conv_bias, None)
        self.g_norm = FusedRMSNormGated(self.input_dim, elementwise_affine, norm_eps)
        self.o_proj = nn.Linear(self.input_dim, hidden_size, bias=False)

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False,
                lower_bound: Optional[Tensor] = None, *, cu_seqlens: Optional[Tensor] = None,
                group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``.

        ``lower_bound`` (``[input_dim]``, HGRN's per-layer forget-gate floor) applies for
        ``layer_idx > 0`` as in FLA.
        """
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        i, f = self.i_proj(x), self.f_proj(x)
        if self.use_short_conv:
            i, f = call.convs((self.i_conv1d, i), (self.f_conv1d, f))
        wide = _wide(x)
        if use_fused(x.device):
            # one fused pass over both projections
            i, f = hgrn_gates(i, f, lower_bound if self.layer_idx else None)
        else:
            f = F.logsigmoid(f.to(wide))
            if lower_bound is not None and self.layer_idx:
                lb = lower_bound.to(wide)
                f = torch.logaddexp(lb.log(), torch.log1p(-lb) + f)
            i = F.silu(i.to(wide)) * (1 - f.exp())
        o = call.op("hgrn", i.to(x.dtype), f, **self._op_kwargs(cu_seqlens, group))
        o = self.g_norm(o, self.g_proj(x))
        return self.o_proj(o.to(x.dtype)), None, call.finish()


# ------------------------------------------------------------------------ Gated DeltaNet
class GatedDeltaNet(SPMixin):
    """``fla.layers.GatedDeltaNet``:
    ``S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` with L2-normalised q, k,
    ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)``, ``b = sigmoid(b_proj(x))``
    (times 2 with ``allow_neg_eigval``).

    Parameters: ``q_proj, k_proj, v_proj, a_proj, b_proj, A_log, dt_bias, q_conv1d, k_conv1d,
    v_conv1d, g_proj, o_norm, o_proj``.  ``num_v_heads > num_heads`` (GVA) shares each q/k
    head among ``num_v_heads / num_heads`` value heads.
    """

    state_v_first = True

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: Optional[int] = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: Optional[int] = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", *, group=None,
                 strategy: str = "auto", **kwargs):
        super().__init__()
        self._sp_init(group, strategy)
        self.mode, self.allow_neg_eigval = mode, allow_neg_eigval
        self.hidden_size, self.expand_v = hidden_size, expand_v
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.head_dim, self.num_heads = head_dim, num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim, self.head_v_dim = head_dim, int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx = layer_idx
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} times head_dim={head_dim} is not an integer")
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_heads={num_heads}")
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        A = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias, "silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias, "silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, conv_bias, "silu")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps,
                                            activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, *,
                cu_seqlens: Optional[Tensor] = None, group=_UNSET, **kwargs):
        """``hidden_states [B, T_local, hidden]`` ->
        ``(o [B, T_local, hidden], None, past_key_values)``."""
        call = self._begin(hidden_states, group, attention_mask, past_key_values, use_cache,
                           cu_seqlens)
        group = call.group
        x = hidden_states
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            # q and k leave the convolution L2-normalised per head (fused into its kernel)
            q, k, v = call.convs((self.q_conv1d, q, self.head_k_dim),
                                 (self.k_conv1d, k, self.head_k_dim), (self.v_conv1d, v))
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        rep = self.num_v_heads // self.num_heads
        q = _repeat_kv(_heads(q, self.head_k_dim), rep)
        k = _repeat_kv(_heads(k, self.head_k_dim), rep)
        v = _heads(v, self.head_v_dim)
        wide = _wide(x)
        if use_fused(x.device):
            g, beta = gdn_gates(self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias,
                                2.0 if self.allow_neg_eigval else 1.0)
        else:
            beta = torch.sigmoid(self.b_proj(x).to(wide))
            if self.allow_neg_eigval:
                beta = beta * 2.0
            g = -self.A_log.to(wide).exp() * F.softplus(self.a_proj(x).to(wide)
                                                        + self.dt_bias.to(wide))
        o = call.op("gated_delta_rule", q, k, v, g, beta,
                    use_qk_l2norm_in_kernel=not self.use_short_conv,
                    **self._op_kwargs(cu_seqlens, group))
        if self.use_gate:
            o = self.o_norm(o, _heads(self.g_proj(x), self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(_flat(o).to(x.dtype)), None, call.finish()


#: Mixer names for :mod:`forge_dist.nn.model` and the training config.
MIXERS = {
    "linear_attn": LinearAttention,
    "retnet": MultiScaleRetention,
    "lightning": LightningAttention,
    "simple_gla": SimpleGatedLinearAttention,
    "mamba2": Mamba2,
    "gla": GatedLinearAttention,
    "hgrn": HGRNAttention,
    "gdn": GatedDeltaNet,
}

"""A small sequence-parallel language model built from the :mod:`forge_dist.nn` mixers.

Layout and parameter names follow FLA's ``*ForCausalLM`` models: ``model.embeddings``,
``model.layers.{i}.{attn_norm, attn, mlp_norm, mlp.{gate_proj, up_proj, down_proj}}``,
``model.norm``, ``lm_head``.  Each rank holds a token shard ``[B, T_local]``; parameters are
replicated, so state dicts are the same on every rank and at every SP degree.

Loss: the mean cross entropy over *all* labelled tokens of all ranks in ``loss_group``
(sequence- and data-parallel ranks together), from an all-reduce of the summed loss and of the
token count.  After ``loss.backward()`` on every rank, the sum of the ranks' parameter
gradients is the gradient of that global loss (:func:`sum_gradients`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import MIXERS
from .norm import RMSNorm


@dataclass
class LMConfig:
    """Model hyper-parameters; ``mixer`` is a name of :data:`forge_dist.nn.layers.MIXERS` or a
    comma-separated list cycled over the layers (e.g. ``"gdn,gla"``)."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    mixer: str = "gdn"
    num_heads: int = 4
    head_dim: int = 0          # 0: hidden_size // num_heads (GDN, Mamba2)
    expand_v: float = 1.0
    use_short_conv: bool = True
    conv_size: int = 4
    state_size: int = 16       # Mamba2's N
    intermediate_size: int = 0  # 0: FLA's rule, 8/3 * hidden rounded up to a multiple of 32
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    strategy: str = "auto"
    init_std: float = 0.02

    def mixers(self) -> List[str]:
        names = [m.strip() for m in self.mixer.split(",") if m.strip()]
        for m in names:
            if m not in MIXERS:
                raise ValueError(f"mixer: unknown name {m!r}; known: {sorted(MIXERS)}")
        return [names[i % len(names)] for i in range(self.num_layers)]


def build_mixer(name: str, cfg: LMConfig, layer_idx: int) -> nn.Module:
    """One token mixer of the family ``name`` sized from ``cfg``."""
    h, H = cfg.hidden_size, cfg.num_heads
    hd = cfg.head_dim or h // H
    common = dict(layer_idx=layer_idx, strategy=cfg.strategy, norm_eps=cfg.norm_eps)
    conv = dict(use_short_conv=cfg.use_short_conv, conv_size=cfg.conv_size)
    if name == "linear_attn":
        return MIXERS[name](hidden_size=h, num_heads=H, expand_v=cfg.expand_v,
                            feature_map="elementwise_product", **common)
    if name == "retnet":
        return MIXERS[name](hidden_size=h, num_heads=H, expand_v=cfg.expand_v, **conv, **common)
    if name == "lightning":
        return MIXERS[name](hidden_size=h, num_heads=H, expand_v=cfg.expand_v,
                            num_layers=cfg.num_layers, **conv, **common)
    if name == "simple_gla":
        return MIXERS[name](hidden_size=h, num_heads=H, expand_v=cfg.expand_v, **conv, **common)
    if name == "mamba2":
        return MIXERS[name](hidden_size=h, head_dim=hd, state_size=cfg.state_size, expand=2,
                            conv_kernel=cfg.conv_size, **common)
    if name == "gla":
        return MIXERS[name](hidden_size=h, num_heads=H, expand_k=0.5, expand_v=cfg.expand_v,
                            **conv, **common)
    if name == "hgrn":
        return MIXERS[name](hidden_size=h, **conv, **common)
    if name == "gdn":
        return MIXERS[name](hidden_size=h, num_heads=H, head_dim=hd, expand_v=cfg.expand_v,
                            **conv, **common)
    raise ValueError(f"mixer: unknown name {name!r}; known: {sorted(MIXERS)}")


class GatedMLP(nn.Module):
    """SwiGLU MLP with FLA's names: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``."""

    def __init__(self, cfg: LMConfig, layer_idx: int, mixer: str):
        super().__init__()
        inter = cfg.intermediate_size or 32 * -(-int(cfg.hidden_size * 8 / 3) // 32)
        self.attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = build_mixer(mixer, cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, inter)

    def forward(self, x: Tensor, *, cu_seqlens=None, group=None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cu_seqlens=cu_seqlens, group=group)[0]
        return x + self.mlp(self.mlp_norm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, m) for i, m in enumerate(cfg.mixers()))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


class LMOutput(NamedTuple):
    loss: Optional[Tensor]       # global mean loss (same value on every rank of loss_group)
    logits: Tensor               # [B, T_local, vocab]
    num_tokens: Optional[Tensor]  # global number of labelled tokens (int64 scalar)
    num_correct: Optional[Tensor]  # global number of labelled tokens predicted right


class _GlobalSum(torch.autograd.Function):
    """All-reduce sum whose backward is the identity: every rank holds the same global value,
    and each rank's local term gets that value's gradient once."""

    @staticmethod
    def forward(ctx, x: Tensor, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class ForgeLM(nn.Module):
    """Embedding, ``num_layers`` blocks, final RMSNorm, (tied) head; SP-aware forward."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embeddings.weight

    def _init(self, m: nn.Module) -> None:
        # FLA's _init_weights: N(0, 0.02) for linears and embeddings; other params keep the
        # family-specific inits set by the layers (A_log, dt_bias, D, convs, norms).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=self.config.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None, *,
                cu_seqlens: Optional[Tensor] = None, group=None,
                loss_group=None) -> LMOutput:
        """Run this rank's token shard.

        Args:
            input_ids: ``[B, T_local]`` int64, rank r's contiguous shard.
            labels: ``[B, T_local]`` targets, ``-100`` where no loss is taken.
            cu_seqlens: global packed offsets (``B == 1``) or ``None``.
            group: sequence-parallel group (``None``: one rank holds the whole sequence).
            loss_group: ranks over which the loss is averaged (default ``group``); pass the
                world (SP x DP) group to average over the whole global batch.
        """
        x = self.model.embeddings(input_ids)
        for block in self.model.layers:
            x = block(x, cu_seqlens=cu_seqlens, group=group)
        logits = self.lm_head(self.model.norm(x))
        if labels is None:
            return LMOutput(None, logits, None, None)
        loss_group = group if loss_group is None else loss_group
        # 16-bit logits in fp32; an fp64 model's loss stays fp64 (an fp32 sum differs by an
        # ulp between one process and the ranks' partial sums)
        flat = logits.to(torch.promote_types(logits.dtype, torch.float32))
        flat = flat.reshape(-1, logits.shape[-1])
        tgt = labels.reshape(-1)
        loss_sum = F.cross_entropy(flat, tgt, ignore_index=-100, reduction="sum")
        mask = tgt != -100
        stats = torch.stack([mask.sum(), (flat.argmax(-1).eq(tgt) & mask).sum()]).to(
            torch.float64)
        if loss_group is not None and dist.get_world_size(loss_group) > 1:
            dist.all_reduce(stats, group=loss_group)
            loss_sum = _GlobalSum.apply(loss_sum, loss_group)
        n = stats[0].clamp_min(1)
        loss = loss_sum / n.to(loss_sum.dtype)
        return LMOutput(loss, logits, stats[0].long(), stats[1].long())


def sum_gradients(params: Sequence[nn.Parameter], group) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` in one flat buffer.

    Summing is right for :class:`ForgeLM`'s global-mean loss: each rank's gradient holds the
    contribution of its own tokens (cross-rank terms arrive through the ops' backward), so the
    full gradient is the sum over sequence- and data-parallel ranks alike.  The sum runs in
    fp32 (fp64 where a gradient is): 16-bit gradients are rounded once, after it, not at
    every partial sum.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    acc = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    flat = torch.cat([g.reshape(-1).to(acc) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(g.dtype, copy=True)
        offset += n


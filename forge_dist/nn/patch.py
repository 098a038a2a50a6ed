"""Swap the token mixers of an FLA model for the sequence-parallel layers of this package.

:func:`patch` walks an ``nn.Module`` tree, and every module whose class *name* is one of
FLA's layer classes (``GatedDeltaNet``, ``GatedLinearAttention``, ``HGRNAttention``, ...) is
replaced by the :mod:`forge_dist.nn.layers` class of the same name, built from the original's
hyper-parameters and loaded with its ``state_dict`` strictly (a missing or unexpected key, or
a shape mismatch, raises before anything is replaced).  FLA itself is not imported: matching
is by class name, so any module with FLA's names and attributes can be patched.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn

from . import layers

#: FLA class name -> our class
FLA_LAYERS: Dict[str, type] = {
    "LinearAttention": layers.LinearAttention,
    "MultiScaleRetention": layers.MultiScaleRetention,
    "LightningAttention": layers.LightningAttention,
    "SimpleGatedLinearAttention": layers.SimpleGatedLinearAttention,
    "GatedLinearAttention": layers.GatedLinearAttention,
    "HGRNAttention": layers.HGRNAttention,
    "GatedDeltaNet": layers.GatedDeltaNet,
    "Mamba2": layers.Mamba2,
}

#: constructor arguments read from the FLA module's attributes (when present)
_ARGS = {
    "LinearAttention": ["mode", "hidden_size", "num_heads", "num_kv_heads", "norm_q", "norm_k",
                        "layer_idx"],
    "MultiScaleRetention": ["mode", "hidden_size", "num_heads", "num_kv_heads",
                            "use_short_conv", "conv_size", "conv_bias", "use_output_gate",
                            "layer_idx"],
    "LightningAttention": ["hidden_size", "num_heads", "layer_idx", "num_layers"],
    "SimpleGatedLinearAttention": ["mode", "hidden_size", "num_heads", "num_kv_heads",
                                   "use_short_conv", "conv_size", "conv_bias",
                                   "gate_logit_normalizer", "layer_idx"],
    "GatedLinearAttention": ["mode", "hidden_size", "num_heads", "num_kv_heads",
                             "use_short_conv", "conv_size", "conv_bias", "use_output_gate",
                             "gate_logit_normalizer", "clamp_min", "layer_idx"],
    "HGRNAttention": ["mode", "hidden_size", "expand_ratio", "use_short_conv", "conv_size",
                      "conv_bias", "layer_idx"],
    "GatedDeltaNet": ["mode", "hidden_size", "expand_v", "head_dim", "num_heads",
                      "num_v_heads", "use_gate", "use_short_conv", "allow_neg_eigval",
                      "conv_size", "conv_bias", "layer_idx"],
    "Mamba2": ["num_heads", "head_dim", "hidden_size", "state_size", "expand", "n_groups",
               "chunk_size", "layer_idx"],
}


def _ratio(m: nn.Module, num: str, den: str) -> Optional[float]:
    a, b = getattr(m, num, None), getattr(m, den, None)
    return None if a is None or not b else a / b


def _kwargs(name: str, m: nn.Module) -> dict:
    kw = {a: getattr(m, a) for a in _ARGS[name] if hasattr(m, a)}
    if name in ("LinearAttention", "MultiScaleRetention", "SimpleGatedLinearAttention",
                "GatedLinearAttention", "LightningAttention"):
        for arg, num in (("expand_k", "key_dim"), ("expand_v", "value_dim")):
            r = _ratio(m, num, "hidden_size")
            if r is not None:
                kw[arg] = r
    if name == "GatedLinearAttention" and hasattr(m, "gk_proj"):
        kw["gate_low_rank_dim"] = m.gk_proj[0].out_features
    if name == "LinearAttention" and not hasattr(m, "feature_map_q"):
        kw["feature_map"] = "identity"
    if name == "Mamba2":
        kw["state_size"] = getattr(m, "ssm_state_size", kw.get("state_size"))
        kw["conv_kernel"] = getattr(m, "conv_kernel_size", 4)
        kw["use_conv_bias"] = getattr(m, "use_conv_bias", True)
    return kw


def patch(model: nn.Module, *, group=None, strategy: str = "auto",
          kwargs: Optional[Dict[str, dict]] = None) -> List[str]:
    """Replace FLA mixers inside ``model`` in place; returns the replaced modules' paths.

    Args:
        group, strategy: given to every new layer.
        kwargs: per class name, constructor arguments that override (or add to) those read
            from the FLA module, e.g. ``{"GatedLinearAttention": {"feature_map": "relu"}}``.
    Raises:
        RuntimeError: a state dict does not load strictly (nothing is replaced then).
    """
    kwargs = kwargs or {}
    plan = []
    for path, m in model.named_modules():
        name = type(m).__name__
        if path and name in FLA_LAYERS and not isinstance(m, tuple(FLA_LAYERS.values())):
            if any(path.startswith(p + ".") for p, _ in plan):
                continue  # inside a module already being replaced
            kw = _kwargs(name, m)
            kw.update(kwargs.get(name, {}))
            new = FLA_LAYERS[name](group=group, strategy=strategy, **kw)
            p0 = next(iter(m.parameters()), None)
            if p0 is not None:
                new = new.to(device=p0.device, dtype=p0.dtype)
            try:
                new.load_state_dict(m.state_dict(), strict=True)
            except RuntimeError as e:
                raise RuntimeError(f"patch: {path} ({name}): {e}") from e
            new.train(m.training)
            plan.append((path, new))
    for path, new in plan:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, new)
    return [p for p, _ in plan]

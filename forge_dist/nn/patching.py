"""Swap the token mixers of an FLA model for the sequence-parallel layers of this package.

:func:`patch` walks an ``nn.Module`` tree, and every module whose class *name* is one of
FLA's layer classes (``GatedDeltaNet``, ``GatedLinearAttention``, ``HGRNAttention``, ...) is
replaced by the :mod:`forge_dist.nn.layers` class of the same name, loaded with its
``state_dict`` strictly.  FLA itself is not imported: matching is by class name.

The new layer's constructor arguments come from the FLA module: its attributes of the same
names, and what FLA keeps only inside submodules (a norm's ``eps`` and affine flag, the output
gate's activation, feature-map functions).  FLA's models build their layers with their
config's values (``norm_eps=1e-6`` rather than the layers' default ``1e-5``, for one), so a
value missed here changes the model silently.  :func:`check_same_config` therefore compares
every plain attribute of the FLA module and of its submodules with the new layer's, and the
patch refuses (nothing is replaced) when one differs.
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional

import torch
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

#: activation names told apart by :func:`activation_name` (FLA's ``ACT2FN`` keys)
_ACTIVATIONS: Dict[str, Callable] = {
    "identity": lambda x: x, "relu": torch.relu, "silu": nn.functional.silu,
    "sigmoid": torch.sigmoid, "elu": lambda x: nn.functional.elu(x) + 1.0,
}
_PROBE = torch.linspace(-3.0, 3.0, 13, dtype=torch.float64)
#: the norm submodule FLA's layers keep their ``norm_eps`` / ``elementwise_affine`` in
_NORMS = ("o_norm", "g_norm_swish_gate", "g_norm", "norm")
#: attributes that are not hyper-parameters (or differ by design) and are not compared
_NOT_COMPARED = {"training", "backend", "group", "strategy", "use_custom_ops"}


def _probe(fn, device) -> Optional[torch.Tensor]:
    """``fn`` on a probe tensor on ``device`` (``None`` when it cannot run there: FLA's
    Triton activations need CUDA tensors, and an autotuner a GPU)."""
    try:
        return fn(_PROBE.to(device=device, dtype=torch.float32)).double().cpu()
    except Exception:
        return None


#: name fragments of activation classes and functions (FLA's Triton ``SigmoidFunction``,
#: ``nn.SiLU``, ``elu_p1`` ...), in the order tried
_NAME_FRAGMENTS = (("sigmoid", "sigmoid"), ("swish", "silu"), ("silu", "silu"),
                   ("gelu", None), ("relu", "relu"), ("elu", "elu"), ("identity", "identity"))


def _name_of(fn) -> Optional[str]:
    names = [getattr(fn, "__name__", ""), getattr(fn, "__qualname__", ""), type(fn).__name__,
             getattr(getattr(fn, "__self__", None), "__name__", "")]
    text = " ".join(str(n) for n in names).lower()
    for fragment, name in _NAME_FRAGMENTS:
        if fragment in text:
            return name
    return None


def activation_name(fn, device=None) -> Optional[str]:
    """The ``ACT2FN`` name of an element-wise function (``None`` for ``None``): by its values
    on a probe where it runs on ``device``, else by its name."""
    if fn is None:
        return None
    values = _probe(fn, device or "cpu")
    if values is not None:
        for name, ref in _ACTIVATIONS.items():
            if torch.allclose(values, ref(_PROBE.clone()), atol=1e-5):
                return name
    elif _name_of(fn) is not None:
        return _name_of(fn)
    raise NotImplementedError(f"activation {fn!r} is not supported; the layers support "
                              f"{list(_ACTIVATIONS)}")


def _same_function(f, g, device=None) -> bool:
    """Two element-wise functions agree (``None`` only equals ``None``)."""
    if f is None or g is None:
        return f is g
    try:
        return activation_name(f, device) == activation_name(g, device)
    except NotImplementedError:
        a, b = _probe(f, device or "cpu"), _probe(g, device or "cpu")
        return a is not None and b is not None and torch.allclose(a, b, atol=1e-5)


def _norm(m: nn.Module) -> Optional[nn.Module]:
    for name in _NORMS:
        sub = getattr(m, name, None)
        if isinstance(sub, nn.Module) and hasattr(sub, "eps"):
            return sub
    return None


def layer_kwargs(name: str, m: nn.Module) -> dict:
    """Constructor arguments of ``FLA_LAYERS[name]`` that rebuild the FLA module ``m``."""
    cls = FLA_LAYERS[name]
    params = inspect.signature(cls.__init__).parameters
    plain = (bool, int, float, str, tuple, list, type(None))
    kw = {p: getattr(m, p) for p in params
          if p not in ("self", "group", "strategy", "kwargs") and hasattr(m, p)
          and isinstance(getattr(m, p), plain)}
    p0 = next(iter(m.parameters()), None)
    device = None if p0 is None else p0.device
    norm = _norm(m)
    if norm is not None:
        kw["norm_eps"] = norm.eps
        kw["elementwise_affine"] = getattr(norm, "weight", None) is not None
    for arg, dim in (("expand_k", "key_dim"), ("expand_v", "value_dim")):
        if arg in params and name != "GatedDeltaNet" and getattr(m, dim, None) is not None:
            kw[arg] = getattr(m, dim) / m.hidden_size
    if hasattr(m, "feature_map_fn"):
        kw["feature_map"] = activation_name(m.feature_map_fn, device)
    if "gate_fn" in params:
        if getattr(m, "fuse_norm_and_gate", False):
            kw["gate_fn"], kw["fuse_norm"] = "swish", True
        elif callable(getattr(m, "gate_fn", None)):
            kw["gate_fn"], kw["fuse_norm"] = activation_name(m.gate_fn, device), False
    if name == "GatedDeltaNet" and getattr(m, "use_gate", False):
        kw["output_gate_activation"] = m.o_norm.activation
    if name == "GatedLinearAttention" and hasattr(m, "gk_proj"):
        kw["gate_low_rank_dim"] = m.gk_proj[0].out_features
    if name == "LinearAttention":
        fq = getattr(m, "feature_map_q", None)
        if type(fq).__name__ == "HadamardFeatureMap":
            kw["feature_map"] = "elementwise_product"
            kw["tie_feature_map_qk"] = fq is getattr(m, "feature_map_k", None)
        elif fq is not None:
            if isinstance(fq, nn.Module) and any(True for _ in fq.parameters()):
                raise NotImplementedError(f"LinearAttention: the learned feature map "
                                          f"{type(fq).__name__} is not supported")
            kw["feature_map"] = activation_name(fq, device)
        kw["output_norm"] = "identity" if isinstance(m.norm, nn.Identity) else "rmsnorm"
    if name == "Mamba2":
        kw["state_size"] = m.ssm_state_size
        kw["conv_kernel"] = m.conv_kernel_size
        kw["hidden_act"] = getattr(m, "activation", "silu")
        if getattr(m, "norm", None) is None:
            kw["rmsnorm"] = False
    return kw


def _is_function(v) -> bool:
    """A callable without parameters (an activation), not a tensor or a layer."""
    if isinstance(v, torch.Tensor) or not callable(v):
        return False
    return not any(True for _ in getattr(v, "parameters", lambda: [])())


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return isinstance(v, (bool, int, float, str, type(None)))


def _canon(v):
    return tuple(_canon(x) for x in v) if isinstance(v, (tuple, list)) else v


def check_same_config(path: str, fla: nn.Module, ours: nn.Module) -> None:
    """Raise when a hyper-parameter of ``fla`` (or of a submodule) differs in ``ours``.

    Compares every public attribute both modules carry under the same submodule path: plain
    values exactly, element-wise functions (activations, feature maps) on a probe.
    """
    ours_subs = dict(ours.named_modules())
    p0 = next(iter(fla.parameters()), None)
    device = None if p0 is None else p0.device
    for sub_path, sub in fla.named_modules():
        mine = ours_subs.get(sub_path)
        if mine is None:
            continue
        for attr, value in vars(sub).items():
            if attr.startswith("_") or attr in _NOT_COMPARED or not hasattr(mine, attr):
                continue
            other = getattr(mine, attr)
            where = ".".join(p for p in (path, sub_path, attr) if p)
            if _plain(value) and _plain(other):
                same = _canon(value) == _canon(other)
            elif value is None or other is None or _is_function(value):
                same = _same_function(value, other, device)  # activations, feature maps
            else:
                continue  # tensors, process groups, ...
            if not same:
                raise ValueError(f"patch: {where}: FLA's layer has {value!r}, the "
                                 f"forge_dist layer would have {other!r}")


def patch(model: nn.Module, *, group=None, strategy: str = "auto",
          kwargs: Optional[Dict[str, dict]] = None) -> List[str]:
    """Replace FLA mixers inside ``model`` in place; returns the replaced modules' paths.

    Args:
        group, strategy: given to every new layer.
        kwargs: per class name, constructor arguments that override (or add to) those read
            from the FLA module, e.g. ``{"GatedLinearAttention": {"feature_map": "relu"}}``
            (the configuration check is skipped for a class given overrides).
    Raises:
        RuntimeError: a state dict does not load strictly; ValueError: a hyper-parameter
            of the FLA module would differ in ours (nothing is replaced in either case).
    """
    kwargs = kwargs or {}
    plan = []
    for path, m in model.named_modules():
        name = type(m).__name__
        if path and name in FLA_LAYERS and not isinstance(m, tuple(FLA_LAYERS.values())):
            if any(path.startswith(p + ".") for p, _ in plan):
                continue  # inside a module already being replaced
            kw = layer_kwargs(name, m)
            kw.update(kwargs.get(name, {}))
            new = FLA_LAYERS[name](group=group, strategy=strategy, **kw)
            if name not in kwargs:
                check_same_config(path, m, new)
            p0 = next(iter(m.parameters()), None)
            if p0 is not None:
                new = new.to(device=p0.device)  # buffers outside the state dict (rotary)
            try:  # assign: every parameter keeps FLA's tensor, dtype included
                new.load_state_dict(m.state_dict(), strict=True, assign=True)
            except RuntimeError as e:
                raise RuntimeError(f"patch: {path} ({name}): {e}") from e
            new.train(m.training)
            plan.append((path, new))
    for path, new in plan:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, new)
    return [p for p, _ in plan]

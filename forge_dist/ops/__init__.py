"""Public ops (FLA conventions; see DESIGN.md section 1) and the named model wrappers."""
import torch

from ..runtime import front as _runtime_front
from . import checks as _checks
from .attention import gated_delta_rule, gla, hgrn, linear_attn, simple_gla
from .models import deltanet, hgrn2, lightning_attn, mamba2_ssd, retnet, retnet_decays

__all__ = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn", "retnet",
           "retnet_decays", "lightning_attn", "mamba2_ssd", "hgrn2", "deltanet"]


def _agree_on_plan(group, device, fields) -> None:
    """A sequence-parallel plan's cross-rank check (dtypes travel as their codes)."""
    _checks.across_ranks(group, device, {
        n: _checks.dtype_code(v) if isinstance(v, torch.dtype) else v for n, v in fields.items()})


# the runtime sits below the ops: what its plans call back into is registered here
_runtime_front.register(
    torch_ops={f.__name__: f for f in (linear_attn, simple_gla, gla, gated_delta_rule, hgrn)},
    agree=_agree_on_plan)

"""Public ops (FLA conventions; see docs/design.md section 1) and the named model wrappers."""
from ..runtime import front as _runtime_front
from .attention import gated_delta_rule, gla, hgrn, linear_attn, simple_gla
from .models import deltanet, hgrn2, lightning_attn, mamba2_ssd, retnet, retnet_decays

__all__ = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn", "retnet",
           "retnet_decays", "lightning_attn", "mamba2_ssd", "hgrn2", "deltanet"]

# the runtime sits below the ops: the PyTorch ops its torch-backend plans run
_runtime_front.register(
    torch_ops={f.__name__: f for f in (linear_attn, simple_gla, gla, gated_delta_rule, hgrn)})

"""Forge programming abstraction: a variant as three PyTorch callables (docs/design.md section 6).

    from forge_dist import dsl
    my_op = dsl.variant("name", chunk_mode=..., decay_mode=..., merge_mode=...)
    o, final = my_op(q, k, v, g, group=pg, strategy="lasp2")

See :mod:`forge_dist.dsl.api` for the callables' contract, :mod:`.analysis` for the checks and
the transition classification, :mod:`.canonical` for the graphs' normal form, :mod:`.lowering`
/ :mod:`.roles` for the Triton templates (inputs matched by role, not name),
:mod:`.generated` for the CUDA path of variants no template fits, :mod:`.executor` for the
portable one, and :mod:`.builtins` / :mod:`.library` for examples.
"""
from . import helpers
from .api import Variant, variant
from .trace import DSLError, cache

__all__ = ["DSLError", "Variant", "cache", "helpers", "variant"]

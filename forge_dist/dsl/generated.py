"""The generated path: how a variant that fits no template runs on CUDA.

This is the first floor the issue asks for, not yet chunk-level Triton written from the
phases: the executor's five graphs (``chunk_mode``, ``decay_mode``, ``merge_mode`` and the
linear parts of the last two, :mod:`.executor`) are compiled by Inductor
(``torch.compile(dynamic=True)``: one compile serves every chunk count and the ragged tail's
chunk length), and the inter-chunk state pass is the executor's, as one Triton kernel for
forward calls of identity / scalar / diagonal transitions (:mod:`.scan`; the Python loop over
chunks otherwise).  So a variant never runs as eager PyTorch graphs on CUDA; it still
materialises every chunk's state, as the executor does, which the templates' walkers never
do.

:func:`path_for` picks the path of a call (``template`` / ``generated`` / ``executor``), and
:func:`warn_once` says, once per variant, when a CUDA call takes anything but a template.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..variants import chunked as ck
from .placement import use_kernels
from .scan import scan_chunks

TEMPLATE, GENERATED, EXECUTOR = "template", "generated", "executor"


@dataclass
class Graphs:
    """The callables :func:`forge_dist.dsl.executor.summarize` runs (graph modules, or their
    compiled forms)."""

    chunk: Callable
    decay: Callable
    merge: Callable
    decay_linear: Callable
    merge_linear: Callable
    scan: Callable = ck.scan_chunks  # the inter-chunk state pass


def eager_graphs(v) -> Graphs:
    """The traced graph modules and the executor's loop scan."""
    return Graphs(v.chunk.gm, v.decay.gm, v.merge.gm, v.decay_linear, v.merge_linear)


def compile_enabled() -> bool:
    """Inductor compilation of the generated path (``FORGE_DIST_DSL_COMPILE=0`` turns it
    off: the eager graphs run instead, as on the CPU)."""
    return os.environ.get("FORGE_DIST_DSL_COMPILE", "1") != "0" and hasattr(torch, "compile")


def compiled_graphs(v, backend: str = "inductor") -> Graphs:
    """The variant's graphs under ``torch.compile`` (compiled lazily, at their first call);
    ``backend`` other than Inductor only to test the wiring on a CPU machine."""
    def build(gm):
        return torch.compile(gm, backend=backend, dynamic=True)

    g = eager_graphs(v)
    return Graphs(*(build(f) for f in (g.chunk, g.decay, g.merge, g.decay_linear,
                                        g.merge_linear)), scan=scan_chunks)


def path_for(v, device: torch.device) -> str:
    """The path a call on ``device`` takes: the Triton ``template`` when the variant lowers
    and kernels run there; on CUDA otherwise the ``generated`` path (when compilation is
    on); the ``executor`` (the eager graphs) elsewhere."""
    if v.lowering is not None and use_kernels(device):
        return TEMPLATE
    return unlowered_path(device)


def unlowered_path(device: torch.device) -> str:
    """The path of a call that takes no template: ``generated`` on CUDA (when compilation is
    on), the ``executor`` elsewhere."""
    if device.type == "cuda" and compile_enabled() and \
            os.environ.get("FORGE_DIST_KERNELS", "auto") != "torch":
        return GENERATED
    return EXECUTOR


def warn_once(v, device: torch.device, path: str, why: str = "") -> None:
    """One ``UserWarning`` per variant when a CUDA call runs through anything but a
    template: which path, why no template fits (or ``why`` this call takes none), and the
    change that would let it lower."""
    if device.type != "cuda" or path == TEMPLATE or getattr(v, "_warned_path", False):
        return
    v._warned_path = True
    how = ("Inductor-compiled graph executor (generated path)" if path == GENERATED else
           "eager PyTorch graph executor")
    tail = (f"{why}." if why else
            f"{v.lowering_reason}. To lower it: {v.lowering_hint}.")
    warnings.warn(f"dsl variant {v.name!r} runs on CUDA through the {how}, not a Triton "
                  f"template: {tail}", UserWarning, stacklevel=3)


def describe(v) -> str:
    """The ``execution`` line of :meth:`~.api.Variant.describe`."""
    if v.lowering is not None:
        return (f"Triton template {v.lowering.template!r} on CUDA ({v.lowering.summary()}); "
                f"graph executor elsewhere")
    cuda = ("generated on CUDA (the phases compiled by Inductor, the executor's state pass)"
            if compile_enabled() else
            "graph executor (PyTorch) on CUDA (FORGE_DIST_DSL_COMPILE=0)")
    return (f"{cuda}; graph executor elsewhere; no Triton template: {v.lowering_reason}; "
            f"to lower: {v.lowering_hint}")

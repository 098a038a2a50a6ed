"""A layer captured as CUDA graphs: each call replays its forward (and its backward), with no
host work per call beyond copying the input in.

At short sequences and in sequence-parallel calls the layers are host-bound: the host
launches their kernels slower than the GPU runs them (docs/performance.md, "Layers").  A
CUDA graph replays every launch of a call at once.  The ops' plans and the halos are
capturable: no host synchronisation, buffers kept per signature (docs/design.md section 7).

    layer = forge_dist.nn.GatedDeltaNet(hidden_size=1024, num_heads=6).cuda().bfloat16()
    step = forge_dist.nn.graphed(layer, torch.randn(2, 4096, 1024, device="cuda",
                                                   dtype=torch.bfloat16, requires_grad=True))
    o = step(x)        # x like the sample (shape, dtype, device, requires_grad)
    o.sum().backward() # replays the backward graph: x.grad and the parameters' .grad
    (captured under torch.no_grad(): one forward graph, for inference)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn


class _Output(nn.Module):
    """The layer's output tensor alone (the layers return ``(o, None, cache)``)."""

    def __init__(self, layer: nn.Module, kwargs: dict):
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def graphed(layer: nn.Module, sample: Tensor, **kwargs: Any) -> Callable[[Tensor], Tensor]:
    """``layer`` captured for inputs like ``sample``.  The grad mode at the capture decides
    what replays do:

    * with grad on, ``torch.cuda.make_graphed_callables`` (three warm-up calls, then a
      forward and a backward graph): replays give ``x``'s gradient (where ``sample``
      requires it) and the parameters';
    * under ``torch.no_grad()``, one forward graph (three warm-up calls on a side stream
      first): an inference call, whose output buffer the next replay overwrites (clone it
      to keep it).

    Args:
        layer: a :mod:`forge_dist.nn` layer (or any module taking ``x [B, T, hidden]``) on
            the GPU, in training or eval mode as it will be replayed; a sequence-parallel
            layer holds its group.
        sample: ``[B, T_local, hidden]`` on the GPU.
        kwargs: keyword arguments of every call (fixed at capture, e.g. ``cu_seqlens``).
    Returns:
        ``x -> o [B, T_local, hidden]`` for ``x`` of ``sample``'s shape, dtype, device and
        ``requires_grad``.
    Raises:
        ValueError: ``sample`` is not a CUDA tensor; later, a call's ``x`` differs from it.
    """
    if not isinstance(sample, Tensor) or sample.device.type != "cuda":
        got = sample.device if isinstance(sample, Tensor) else type(sample).__name__
        raise ValueError(f"graphed: sample must be a CUDA tensor, got {got}")
    want = (tuple(sample.shape), sample.dtype, sample.device, sample.requires_grad)
    module = _Output(layer, kwargs)
    if torch.is_grad_enabled():
        run = torch.cuda.make_graphed_callables(module, (sample,))
    else:
        run = _forward_graph(module, sample)

    def call(x: Tensor) -> Tensor:
        got = ((tuple(x.shape), x.dtype, x.device, x.requires_grad)
               if isinstance(x, Tensor) else None)
        if got != want:
            raise ValueError(f"graphed: x must match the captured sample (shape, dtype, "
                             f"device, requires_grad) {want}; got "
                             f"{got if got else type(x).__name__} (capture again for another)")
        return run(x)
    return call


def _forward_graph(module: nn.Module, sample: Tensor) -> Callable[[Tensor], Tensor]:
    """One forward graph of ``module`` on a static copy of ``sample`` (no autograd)."""
    static = sample.detach().clone()
    side = torch.cuda.Stream(static.device)
    side.wait_stream(torch.cuda.current_stream(static.device))
    with torch.cuda.stream(side):  # warm-up: compile, build the plans, fill the caches
        for _ in range(3):
            module(static)
    torch.cuda.current_stream(static.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(static)

    def replay(x: Tensor) -> Tensor:
        static.copy_(x)
        graph.replay()
        return out
    return replay

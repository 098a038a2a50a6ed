"""Elementwise prologue kernels: one generated map over a whole tensor, and its derivative.

A DSL variant's inputs often pass through an elementwise chain before the template's
kernels (``elu(q) + 1``, ``logsigmoid(g)``; :mod:`forge_dist.dsl.lowering` extracts it and
:mod:`forge_dist.dsl.codegen` writes it as a jitted function of a tile).  Run as PyTorch ops,
``elu(x) + 1`` is two passes over the tensor forward and more backward; here it is one read
and one write: ``_map_kernel`` applies the generated map, ``_map_grad_kernel`` its generated
vector-Jacobian product ``dy * f'(x)`` (the forward values recomputed in registers, nothing
saved but ``x``).  Both compute in fp32 and round once to the tensor's dtype.  A map of
several inputs (a shared role's, or one that borrows another role's inputs) of one shape,
or per-head scalars broadcast onto it, runs the same way through ``_map_n_kernel`` and
``_map_n_grad_kernel``.

Measured on an H200 (``scaling_benchmarks/results/dsl_prologue_*``): a map applied here before
the template beats both the PyTorch ops and applying the map to every tile inside the walk
(the walk is latency bound, so per-tile work there lengthens every chunk step).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from .compat import HAVE_TRITON, cdiv, tl, triton

# one program maps BLOCK elements (H200, q and k of [1, 64K, 32, 128] bf16 through elu + 1:
# 1024 / 4 warps 509 us, 4096 / 4 warps 517 us, 8192 / 8 warps 533 us)
BLOCK = 1024
NUM_WARPS = 4

if HAVE_TRITON:

    # N stays specialised: knowing N % 16 == 0 lets Triton vectorise the masked loads and
    # stores (with do_not_specialize=["N"] the map of a [1, 64K, 32, 128] bf16 tensor took
    # 776 us instead of 255 on an H200)
    @triton.jit
    def _map_kernel(x, y, N, MAP: tl.constexpr, BLOCK: tl.constexpr):
        """``y = MAP(x)`` over ``N`` contiguous elements; grid ``(cdiv(N, BLOCK),)``."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        b = tl.load(x + o, mask=m, other=0.0)
        tl.store(y + o, MAP(b).to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _map_grad_kernel(x, dy, dx, N, GRAD: tl.constexpr, BLOCK: tl.constexpr):
        """``dx = GRAD(x, dy)`` (``dy * MAP'(x)``) over ``N`` contiguous elements."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        b = tl.load(x + o, mask=m, other=0.0)
        d = tl.load(dy + o, mask=m, other=0.0)
        tl.store(dx + o, GRAD(b, d).to(dx.dtype.element_ty), mask=m)


    @triton.jit
    def _load_rep(x, o, m, R: tl.constexpr):
        """Element ``o`` of the output as input ``x`` gives it: its own element (``R = 1``,
        the output's shape), or element ``o // R`` of a per-head scalar broadcast over the
        output's trailing dim of ``R``."""
        if R == 1:
            return tl.load(x + o, mask=m, other=0.0)
        return tl.load(x + o // R, mask=m, other=0.0)

    # a map of several inputs (a shared or borrowing role's, ``f(x0, x1, ...)``), up to
    # MAX_INPUTS: unused pointer slots repeat x0 and are not read.  R0..R3: each input's
    # repeat (:func:`_load_rep`)
    @triton.jit
    def _map_n_kernel(x0, x1, x2, x3, y, N, MAP: tl.constexpr, NIN: tl.constexpr,
                      BLOCK: tl.constexpr, R0: tl.constexpr = 1, R1: tl.constexpr = 1,
                      R2: tl.constexpr = 1, R3: tl.constexpr = 1):
        """``y = MAP(x0, ..., x{NIN-1})`` over the ``N`` contiguous elements of ``y``."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        b0 = _load_rep(x0, o, m, R0)
        b1 = _load_rep(x1, o, m, R1)
        if NIN == 2:
            v = MAP(b0, b1)
        else:
            b2 = _load_rep(x2, o, m, R2)
            if NIN == 3:
                v = MAP(b0, b1, b2)
            else:
                v = MAP(b0, b1, b2, _load_rep(x3, o, m, R3))
        tl.store(y + o, v.to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _store_grad(dx, o, m, g):
        tl.store(dx + o, g.to(dx.dtype.element_ty), mask=m)

    @triton.jit
    def _map_n_grad_kernel(x0, x1, x2, x3, dy, dx0, dx1, dx2, dx3, N, GRAD: tl.constexpr,
                           NIN: tl.constexpr, BLOCK: tl.constexpr, R0: tl.constexpr = 1,
                           R1: tl.constexpr = 1, R2: tl.constexpr = 1, R3: tl.constexpr = 1):
        """``dx_i = GRAD(x0, ..., dy)[i]`` (``dy * d MAP / d x_i``) for ``i < NIN``, every
        ``dx_i`` of ``dy``'s ``N`` elements (a repeated input's summed by the caller)."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        d = tl.load(dy + o, mask=m, other=0.0)
        b0 = _load_rep(x0, o, m, R0)
        b1 = _load_rep(x1, o, m, R1)
        if NIN == 2:
            g0, g1 = GRAD(b0, b1, d)
        else:
            b2 = _load_rep(x2, o, m, R2)
            if NIN == 3:
                g0, g1, g2 = GRAD(b0, b1, b2, d)
            else:
                g0, g1, g2, g3 = GRAD(b0, b1, b2, _load_rep(x3, o, m, R3), d)
                _store_grad(dx3, o, m, g3)
            _store_grad(dx2, o, m, g2)
        _store_grad(dx0, o, m, g0)
        _store_grad(dx1, o, m, g1)


MAX_INPUTS = 4  # inputs of one generated map (RG-LRU's input scaling reads four)


def _launch(kernel, fn, *tensors: Tensor) -> None:
    n = tensors[0].numel()
    if n:
        kernel[(cdiv(n, BLOCK),)](*tensors, n, fn, BLOCK=BLOCK, num_warps=NUM_WARPS)


class _MapFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fmap: Callable, fgrad: Callable) -> Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        _launch(_map_kernel, fmap, x, y)
        ctx.save_for_backward(x)
        ctx.fgrad = fgrad
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        _launch(_map_grad_kernel, ctx.fgrad, x, dy.contiguous().to(x.dtype), dx)
        return dx, None, None


def _repeats(shape: torch.Size, xs) -> dict:
    """The kernels' ``R0..R3``: ``shape[-1]`` for an input of ``shape[:-1]`` (a per-head
    scalar broadcast over the trailing dim), else 1."""
    return {f"R{i}": shape[-1] if x.dim() < len(shape) else 1 for i, x in enumerate(xs)}


class _MapNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fmap: Callable, fgrad: Callable, out_dtype: Optional[torch.dtype],
                shape: torch.Size, *xs: Tensor) -> Tensor:
        xs = tuple(x.contiguous() for x in xs)
        dtype = out_dtype or functools.reduce(torch.promote_types, (x.dtype for x in xs))
        y = torch.empty(shape, dtype=dtype, device=xs[0].device)
        n = y.numel()
        if n:
            pad = xs + (xs[0],) * (MAX_INPUTS - len(xs))
            _map_n_kernel[(cdiv(n, BLOCK),)](*pad, y, n, fmap, NIN=len(xs), BLOCK=BLOCK,
                                             num_warps=NUM_WARPS, **_repeats(shape, xs))
        ctx.save_for_backward(*xs)
        ctx.fgrad, ctx.shape = fgrad, shape
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        xs, shape = ctx.saved_tensors, ctx.shape
        reps = _repeats(shape, xs)
        # a repeated input's gradient per output element (fp32), summed over its repeats
        full = tuple(torch.empty_like(x) if reps[f"R{i}"] == 1 else
                     torch.empty(shape, dtype=torch.float32, device=x.device)
                     for i, x in enumerate(xs))
        n = dy.numel()
        if n:
            pad = MAX_INPUTS - len(xs)
            _map_n_grad_kernel[(cdiv(n, BLOCK),)](
                *xs, *(xs[:1] * pad), dy.contiguous(), *full, *(full[:1] * pad), n,
                ctx.fgrad, NIN=len(xs), BLOCK=BLOCK, num_warps=NUM_WARPS, **reps)
        dxs = tuple(d if reps[f"R{i}"] == 1 else d.sum(-1).to(x.dtype)
                    for i, (x, d) in enumerate(zip(xs, full)))
        return (None, None, None, None) + dxs


def apply_map(x: Tensor, fmap: Callable, fgrad: Callable) -> Tensor:
    """``fmap`` applied to every element of ``x`` (any shape, a floating dtype), in
    ``x``'s dtype; differentiable through ``fgrad`` (``dy * fmap'(x)``)."""
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    return _MapFn.apply(x, fmap, fgrad)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ElementwisePrologue:
    """An input's prologue as generated kernels: called on 16- or 32-bit float tensors on a
    device the kernels take (``use_kernels(device)``), it runs :func:`apply_map` (one input)
    or the map of several inputs (a shared or borrowing role's, at most ``MAX_INPUTS``, of
    one shape ``[..., D]``, or of its ``[...]``: per-head scalars broadcast over ``D``, as
    the map's ``x[..., None]`` writes it) in ``out_dtype``, by default their promoted
    dtype (one input's map keeps its dtype; callers cast where they need another);
    otherwise ``torch_fn`` (the same DAG as PyTorch ops; fp64, such as the
    lowering's probes, and inputs of other shapes).

    Args:
        fmap, fgrad: the jitted map and its vector-Jacobian product
            (:func:`forge_dist.dsl.codegen.triton_map` / ``triton_map_grad``).
        torch_fn: the chain as a PyTorch callable.
        use_kernels: ``device -> bool``, whether to launch the kernels for that device.
    """

    def __init__(self, fmap: Callable, fgrad: Callable, torch_fn: Callable,
                 use_kernels: Callable[[torch.device], bool]):
        self.fmap, self.fgrad, self.torch_fn = fmap, fgrad, torch_fn
        self.use_kernels = use_kernels

    def __call__(self, *xs: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
        # the maps compute in fp32: fp64 (the lowering's validation probes) stays exact
        x = xs[0]
        if not (HAVE_TRITON and all(t.dtype in _KERNEL_DTYPES for t in xs)
                and self.use_kernels(x.device)):
            return self.torch_fn(*xs)
        if len(xs) == 1:
            return apply_map(x, self.fmap, self.fgrad)
        shape = max((t.shape for t in xs), key=len)
        if len(xs) <= MAX_INPUTS and all(
                t.device == x.device and t.shape in (shape, shape[:-1]) for t in xs):
            return _MapNFn.apply(self.fmap, self.fgrad, out_dtype, shape, *xs)
        return self.torch_fn(*xs)  # inputs of other shapes


def kernel_prologue(chain_map, chain_grad, torch_fn, use_kernels) -> Optional[ElementwisePrologue]:
    """An :class:`ElementwisePrologue` from codegen results (``(fn, source)`` or ``None``),
    or ``None`` when either has no translation."""
    if chain_map is None or chain_grad is None:
        return None
    return ElementwisePrologue(chain_map[0], chain_grad[0], torch_fn, use_kernels)

"""The elementwise prologue kernels (forge_dist.kernels.prologue): a generated map and its
derivative over whole tensors, against PyTorch; where they hand over to PyTorch; bad input."""
from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

pytest.importorskip("triton")

from forge_dist.dsl import codegen  # noqa: E402
from forge_dist.kernels import prologue  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)


def _maps(f):
    gm = fx.symbolic_trace(f)
    chain = [n for n in gm.graph.nodes if n.op != "output"]
    return codegen.triton_map(chain)[0], codegen.triton_map_grad(chain)[0]


FNS = {"elu+1": lambda x: F.elu(x) + 1.0, "logsigmoid": lambda x: F.logsigmoid(x),
       "silu*2": lambda x: F.silu(x) * 2.0}


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# sizes: less than one block, several blocks with a ragged last one
@pytest.mark.parametrize("shape", [(3, 5), (2, 1500, 3)])
def test_map_and_gradient_match_pytorch(name, dtype, tol, shape):
    f = FNS[name]
    fmap, fgrad = _maps(f)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype).requires_grad_(True)
    y = prologue.apply_map(x, fmap, fgrad)
    assert y.dtype == dtype and y.shape == x.shape
    xd = x.detach().double().requires_grad_(True)
    want = f(xd)
    torch.testing.assert_close(y.double().cpu(), want.detach().cpu(), rtol=tol, atol=tol)
    dy = torch.randn(*shape, generator=gen).to(DEV, dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_want,) = torch.autograd.grad(want, xd, dy.double())
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.double().cpu(), dx_want.cpu(), rtol=tol, atol=tol)


def test_non_contiguous_input_and_gradient():
    fmap, fgrad = _maps(FNS["elu+1"])
    x = torch.randn(7, 6, device=DEV).t().requires_grad_(True)  # a transposed view
    y = prologue.apply_map(x, fmap, fgrad)
    torch.testing.assert_close(y, F.elu(x.detach()) + 1.0)
    dy = torch.randn(7, 6, device=DEV).t()
    (dx,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(dx, torch.where(x.detach() > 0, 1.0, torch.exp(x.detach())) * dy)


def test_empty_tensor():
    fmap, fgrad = _maps(FNS["silu*2"])
    x = torch.empty(0, 4, device=DEV)
    assert prologue.apply_map(x, fmap, fgrad).shape == (0, 4)


def test_elementwise_prologue_hands_over_to_pytorch():
    """fp64 (the maps compute in fp32) and devices the kernels are not asked to run on go to
    the PyTorch chain; the kernels run for 16/32-bit floats where allowed."""
    fmap, fgrad = _maps(FNS["logsigmoid"])
    calls = []
    torch_fn = lambda x: (calls.append(x.dtype), F.logsigmoid(x))[1]  # noqa: E731
    p = prologue.ElementwisePrologue(fmap, fgrad, torch_fn, lambda device: True)
    x = torch.randn(5, device=DEV)
    p(x.double())
    assert calls == [torch.float64]
    torch.testing.assert_close(p(x), F.logsigmoid(x))
    assert calls == [torch.float64]  # the fp32 call ran the kernel
    off = prologue.ElementwisePrologue(fmap, fgrad, torch_fn, lambda device: False)
    off(x)
    assert calls == [torch.float64, torch.float32]


def test_integer_input_is_refused():
    fmap, fgrad = _maps(FNS["elu+1"])
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        prologue.apply_map(torch.arange(4, device=DEV), fmap, fgrad)


def test_kernel_prologue_needs_both_translations():
    fmap, fgrad = _maps(FNS["elu+1"])
    assert prologue.kernel_prologue(None, (fgrad, ""), F.elu, lambda d: True) is None
    assert prologue.kernel_prologue((fmap, ""), None, F.elu, lambda d: True) is None
    assert isinstance(prologue.kernel_prologue((fmap, ""), (fgrad, ""), F.elu, lambda d: True),
                      prologue.ElementwisePrologue)

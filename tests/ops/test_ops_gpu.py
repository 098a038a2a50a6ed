"""Ops on one GPU (Triton kernels) against the fp64 recurrence, forward and backward."""
import pytest
import torch

from forge_dist.selftest import OPS, run_case


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_kernel_path_matches_reference(op, varlen):
    res = run_case(op, "serial", torch.float32, varlen, device="cuda", T_local=200,
                   dims=(64, 80, 128))
    assert res.max_error <= 3e-3, res.errors


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_bf16_outputs(op):
    res = run_case(op, "serial", torch.bfloat16, False, device="cuda", T_local=256,
                   dims=(64, 64, 256))
    assert res.errors["o"] <= 2e-2 and res.errors["final_state"] <= 2e-2, res.errors

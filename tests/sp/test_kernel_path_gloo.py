"""The Triton-kernel path across ranks on the CPU: a gloo world of 3 whose ranks run the
kernels under ``TRITON_INTERPRET=1`` (``FORGE_DIST_KERNELS=triton``), cut into 2 segments
per shard, so the runner's order (summary and kept segment states, state pass, then only
the output walks) is checked forward and backward against the fp64 recurrence."""
import functools

import pytest
import torch

from forge_dist.selftest import run_case, tolerance

from .distributed import run_world

pytest.importorskip("triton")

OPS = ("linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn")
ENV = {"TRITON_INTERPRET": "1", "FORGE_DIST_KERNELS": "triton", "FORGE_DIST_SEGMENTS": "2",
       "FORGE_DIST_TIMEOUT": "120"}


def _rows(group):
    from forge_dist.ops import attention

    assert attention._use_kernels(torch.device("cpu")), "the kernel path is not selected"
    rows = []
    for op in OPS:
        for varlen in (False, True):
            # 72 tokens: a whole and a partial chunk of 64, so each shard has 2 segments
            res = run_case(op, "lasp2", torch.float32, varlen, group=group, T_local=72,
                           dims=(16, 24, 32))
            rows.append({"op": op, "varlen": varlen, "errors": res.errors})
    return rows


@functools.lru_cache(maxsize=None)
def _results():
    return {(r["op"], r["varlen"]): r for r in run_world(3, _rows, env=ENV)}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_kernel_path_matches_reference(op, varlen):
    errors = _results()[(op, varlen)]["errors"]
    tol = tolerance(torch.float32)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative RMSE above {tol:g}: {bad}"
    assert {"o", "final_state", "d_initial_state"} <= set(errors)

"""Our fp64 references agree with flash-linear-attention's naive recurrences.

FLA's naive functions are loaded straight from its files (no package import, which would
pull in its GPU kernels); they compute in fp32, hence the 1e-5 tolerance.  Skipped when
``fla-core`` is not installed.
"""
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forge_dist.selftest import rel_err
from forge_dist.variants import reference as ref


def _naive(module: str):
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / module / "naive.py"
    loader_spec = importlib.util.spec_from_file_location(f"_fla_naive_{module}", path)
    mod = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(mod)
    return mod


gen = torch.Generator().manual_seed(3)
B, T, H, K, V = 2, 40, 2, 8, 6


def r(*s):
    return torch.randn(*s, generator=gen, dtype=torch.float64)


def test_linear_attn():
    q, k, v, S0 = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, H, K, V)
    o, S = _naive("linear_attn").naive_recurrent_linear_attn(
        q, k, v, initial_state=S0.float(), output_final_state=True)
    o_r, S_r = ref.linear_attn_ref(q, k, v, initial_state=S0, output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5


def test_simple_gla():
    q, k, v, S0 = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, H, K, V)
    g = F.logsigmoid(r(B, T, H))
    o, S = _naive("simple_gla").naive_recurrent_simple_gla(
        q, k, v, g, initial_state=S0.float(), output_final_state=True)
    o_r, S_r = ref.simple_gla_ref(q, k, v, g=g, initial_state=S0, output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5


def test_gla():
    q, k, v, S0 = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, H, K, V)
    g = F.logsigmoid(r(B, T, H, K))
    o, S = _naive("gla").naive_recurrent_gla(q, k, v, g, initial_state=S0.float(),
                                             output_final_state=True)
    o_r, S_r = ref.gla_ref(q, k, v, g, initial_state=S0, output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5


def test_gated_delta_rule():
    q, k, v, S0 = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, H, K, V)
    k = k / k.norm(dim=-1, keepdim=True)
    g, beta = F.logsigmoid(r(B, T, H)), torch.sigmoid(r(B, T, H))
    # FLA's naive recurrence takes (q, k, v, beta, g); the public op takes (..., g, beta).
    o, S = _naive("gated_delta_rule").naive_recurrent_gated_delta_rule(
        q, k, v, beta, g, initial_state=S0.float(), output_final_state=True)
    o_r, S_r = ref.gated_delta_rule_ref(q, k, v, g, beta, initial_state=S0,
                                        output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5


def test_hgrn():
    x, g, h0 = r(B, T, 16), F.logsigmoid(r(B, T, 16)), r(B, 16)
    o, h = _naive("hgrn").naive_recurrent_hgrn(x, g, initial_state=h0.float(),
                                               output_final_state=True)
    o_r, h_r = ref.hgrn_ref(x, g, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(h, h_r) < 1e-5

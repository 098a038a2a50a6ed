"""forge on real GPUs: launches tests/comm/multigpu_worker.py under torchrun once and checks
every rank's report (chains per kind, every op fwd+bwd against serial/lasp2/single GPU,
1000 back-to-back calls, the timeout error).  Skipped without two CUDA devices."""
import os

import pytest
import torch

from tests.torchrun_workers import ROOT, run_workers

CHECKS = ["available", "chains_identity", "chains_scalar", "chains_diagonal", "chains_dense",
          "chains_dense_K64_V96", "op_linear_attn", "op_simple_gla", "op_gla",
          "op_gated_delta_rule", "op_hgrn", "plans", "plans_delta", "hgrn_mixed", "back_to_back", "no_host_sync_forge",
          "no_host_sync_lasp2", "no_host_sync_serial", "no_host_sync_pipelined",
          "signature_on_device", "timeout",
          "scan_chains_identity", "scan_chains_scalar", "scan_chains_diagonal", "scan_chains_dense",
          "scan_op_linear_attn", "scan_op_simple_gla", "scan_op_gla", "scan_op_gated_delta_rule",
          "scan_op_hgrn", "no_host_sync_scan",
          "hier_chains_identity", "hier_chains_scalar", "hier_chains_diagonal", "hier_chains_dense",
          "hier_op_linear_attn", "hier_op_simple_gla", "hier_op_gla", "hier_op_gated_delta_rule",
          "hier_op_hgrn", "no_host_sync_hier"]
WORLD = int(os.environ.get("FORGE_MG_WORLD", "2"))  # ranks, one GPU each (4 on a 4-GPU machine)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("forge_mg")
    return run_workers(ROOT / "tests" / "comm" / "multigpu_worker.py", out, WORLD)[0]


@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", CHECKS)
def test_forge_multigpu(reports, name):
    only = [c for c in os.environ.get("FORGE_MG_CHECKS", "").split(",") if c]
    if only and name not in only:
        pytest.skip(f"FORGE_MG_CHECKS selects {only}")
    for r, rep in reports.items():
        assert name in rep, f"rank {r} did not run {name}: {sorted(rep)}"
        assert rep[name]["ok"], f"rank {r} {name}: {rep[name]['detail']}"

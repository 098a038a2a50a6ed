#!/usr/bin/env bash
# Multi-GPU forge tests (needs >= 2 CUDA GPUs on one host, torch with NVSHMEM).
#   tests/comm/run_multigpu.sh            # pytest wrapper (launches torchrun itself)
#   tests/comm/run_multigpu.sh worker DIR # the torchrun worker alone, reports in DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
NPROC="${NPROC:-2}"
if [[ "${1:-}" == "worker" ]]; then
  timeout "${FORGE_MG_TIMEOUT:-300}" torchrun --nproc_per_node "$NPROC" \
    tests/comm/multigpu_worker.py "${2:-/tmp/forge_mg}"
else
  timeout "${FORGE_MG_TIMEOUT:-600}" python -m pytest -q -m multigpu tests/sp/test_forge_multigpu.py "$@"
fi

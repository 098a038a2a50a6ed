#!/usr/bin/env bash
# Generic torchrun wrapper for forge_dist scripts, single- or multi-node.
#
#   launch/torchrun.sh [--nproc-per-node N] [--nnodes N] [--node-rank R]
#                      [--rdzv-endpoint HOST:PORT] [--rdzv-id ID] [--] script.py [args...]
#
# Single node (default): torchrun --standalone, one process per visible GPU.
# Multi-node: run the same line on every node with its --node-rank and one shared
# --rdzv-endpoint (c10d rendezvous on the first node).  Sets our NCCL/NVSHMEM defaults
# (NVLink multicast off) unless the caller exported other values.  DRY_RUN=1 prints the
# command instead of running it.  Environment: PYTHON (default python), NPROC_PER_NODE,
# NNODES, NODE_RANK, RDZV_ENDPOINT, RDZV_ID (same meaning as the flags).
set -euo pipefail

PYTHON=${PYTHON:-python}
nproc=${NPROC_PER_NODE:-}
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
endpoint=${RDZV_ENDPOINT:-}
rdzv_id=${RDZV_ID:-forge_dist}

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node|--nproc_per_node) nproc=$2; shift 2 ;;
    --nnodes) nnodes=$2; shift 2 ;;
    --node-rank|--node_rank) node_rank=$2; shift 2 ;;
    --rdzv-endpoint|--rdzv_endpoint) endpoint=$2; shift 2 ;;
    --rdzv-id|--rdzv_id) rdzv_id=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "torchrun.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -lt 1 ]]; then
  echo "torchrun.sh: name the script to run (see --help)" >&2
  exit 2
fi

if [[ -z "$nproc" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    nproc=$(nvidia-smi -L | wc -l)
  else
    nproc=1
  fi
  [[ "$nproc" -ge 1 ]] || nproc=1
fi

# NVLink multicast stays off (docs/design.md section 4): NCCL, torch symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$nproc")
if [[ "$nnodes" -gt 1 ]]; then
  if [[ -z "$endpoint" ]]; then
    echo "torchrun.sh: --nnodes $nnodes needs --rdzv-endpoint HOST:PORT (the first node)" >&2
    exit 2
  fi
  cmd+=(--nnodes "$nnodes" --node_rank "$node_rank" --rdzv_backend c10d
        --rdzv_endpoint "$endpoint" --rdzv_id "$rdzv_id")
else
  cmd+=(--standalone --nnodes 1)
fi
cmd+=("$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS ${cmd[*]}"
  exit 0
fi
exec "${cmd[@]}"

# Shared by the sbatch scripts: job geometry, rendezvous from the slurm environment, and the
# launch line (srun, one task per GPU; or mpirun).  Source it, then call `launch CMD...`.
#
# Geometry: SLURM_JOB_NUM_NODES / SLURM_NTASKS_PER_NODE inside a job; NODES / GPUS_PER_NODE
# outside one (DRY_RUN=1 on a laptop).  Rendezvous: MASTER_ADDR is the first host of
# SLURM_JOB_NODELIST (`scontrol show hostnames`), MASTER_PORT derives from the job id; each
# task's RANK/LOCAL_RANK/WORLD_SIZE come from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, read by
# forge_dist.launch_env (which also understands OMPI_*/PMI_* and mpi4py for LAUNCHER=mpirun).

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
PYTHON=${PYTHON:-python}
NODES=${SLURM_JOB_NUM_NODES:-${NODES:-1}}
GPUS_PER_NODE=${SLURM_NTASKS_PER_NODE:-${GPUS_PER_NODE:-8}}
GPUS_PER_NODE=${GPUS_PER_NODE%%(*}          # "8(x4)" -> "8"
NTASKS=$(( NODES * GPUS_PER_NODE ))
LAUNCHER=${LAUNCHER:-srun}

if [[ -z "${MASTER_ADDR:-}" ]]; then
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then   # no scontrol (dry run): our own parser
    # Load launch_env.py by path: it needs only the standard library (no torch import).
    MASTER_ADDR=$("$PYTHON" -c "import importlib.util as u, sys; s = u.spec_from_file_location('le', sys.argv[1]); m = sys.modules['le'] = u.module_from_spec(s); s.loader.exec_module(m); print(m.expand_nodelist(sys.argv[2])[0])" "$REPO/forge_dist/launch_env.py" "$SLURM_JOB_NODELIST" 2>/dev/null || echo localhost)
  else
    MASTER_ADDR=localhost
  fi
fi
MASTER_PORT=${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-9500} % 20000 ))}
export MASTER_ADDR MASTER_PORT

# NVLink multicast off everywhere (docs/design.md section 4); keep explicit user choices.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
# Inter-node NVSHMEM transport: NVSHMEM 3.4.5 (torch's pin) has no IBGDA in its device
# bitcode, so puts go through the IBRC proxy; set ibgda with a newer NVSHMEM.
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-ibrc}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# launch CMD... : one task per GPU over the whole allocation.
launch() {
  local line
  case "$LAUNCHER" in
    srun)
      # Every task sees all GPUs of its node and picks cuda:LOCAL_RANK (NCCL and NVSHMEM
      # need the peers visible for CUDA IPC), hence --gpu-bind=none.
      line=(srun --nodes="$NODES" --ntasks="$NTASKS" --ntasks-per-node="$GPUS_PER_NODE"
            --gpu-bind=none --kill-on-bad-exit=1 --export=ALL "$@") ;;
    mpirun)
      line=(mpirun -np "$NTASKS" --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none
            -x MASTER_ADDR -x MASTER_PORT -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
            -x NVSHMEM_DISABLE_NVLS -x NVSHMEM_REMOTE_TRANSPORT "$@") ;;
    *) echo "common.sh: LAUNCHER must be srun or mpirun, got $LAUNCHER" >&2; return 2 ;;
  esac
  echo "+ MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT ${line[*]}"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    return 0
  fi
  "${line[@]}"
}

# run CMD... : a single command on the batch host (printed; skipped in DRY_RUN).
run() {
  echo "+ $*"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    return 0
  fi
  "$@"
}

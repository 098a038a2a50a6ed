#!/usr/bin/env bash
# Submit slurm/weak_scaling.sbatch once per node count, one after another (each job also
# refits the cost model on everything measured so far; the last one sees the whole sweep).
#
#   slurm/sweep_weak_scaling.sh 1 2 4 8 16 [-- benchmark args]
#   DRY_RUN=1 slurm/sweep_weak_scaling.sh 1 2 4      # print the sbatch lines
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
counts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do counts+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
[[ ${#counts[@]} -gt 0 ]] || { echo "usage: $0 NODES... [-- benchmark args]" >&2; exit 2; }
dep=""
for n in "${counts[@]}"; do
  line=(sbatch --parsable --nodes="$n" --chdir="$repo" ${dep:+--dependency=afterany:$dep}
        "$repo/slurm/weak_scaling.sbatch" "$@")
  echo "+ ${line[*]}"
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    dep="<job of $n nodes>"
  else
    dep=$("${line[@]}")
  fi
done

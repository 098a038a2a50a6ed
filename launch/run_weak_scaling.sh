#!/usr/bin/env bash
# Weak-scaling benchmark on this node (or one node of a multi-node job), then the cost
# model calibrated on what it measured.
#
#   launch/run_weak_scaling.sh [--nproc-per-node N] [torchrun.sh options] [-- benchmark args]
#
# Environment: CONFIG (default configs/weak_scaling.toml), OUT (results folder, default
# scaling_benchmarks/results), COST_MODEL=0 to skip the calibration, DRY_RUN=1 to print the
# commands.  Benchmark arguments after "--" are passed on (e.g. --set tokens_per_gpu=131072).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-$repo/configs/weak_scaling.toml}
OUT=${OUT:-$repo/scaling_benchmarks/results}

launch_args=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
  launch_args+=("$1"); shift
done
[[ "${1:-}" == "--" ]] && shift

"$here/torchrun.sh" "${launch_args[@]}" -- "$repo/scaling_benchmarks/weak_scaling.py" \
  --config "$CONFIG" --out "$OUT" "$@"

if [[ "${COST_MODEL:-1}" == "1" && "${NODE_RANK:-0}" == "0" ]]; then
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    echo "$PYTHON $repo/scaling_benchmarks/cost_model.py --config $repo/configs/cost_model.toml --calibrate $OUT/weak_scaling_*_ws*.json --out $OUT"
  else
    shopt -s nullglob
    files=("$OUT"/weak_scaling_*_ws*.json)
    if [[ ${#files[@]} -gt 0 ]]; then
      "$PYTHON" "$repo/scaling_benchmarks/cost_model.py" --config "$repo/configs/cost_model.toml" \
        --calibrate "${files[@]}" --out "$OUT"
    fi
  fi
fi

#!/usr/bin/env bash
# One GPU session's measurements, in stages that each fit one device call (<= 10 min).
# Run from the repo root on a 2 x H200 machine, with the FLA wheels carried in .whl/
# (../shared/device/wheels.sh downloads them).  Everything lands in $OUT (default ./out).
#
# Pass FORGE_DIST_COMMIT=<sha> from the checkout (the device copy has no .git).
#   bash scaling_benchmarks/device_batch.sh tests     # GPU + multi-GPU tests          (~5 min)
#   bash scaling_benchmarks/device_batch.sh kernels   # GPU kernel tests only           (~2 min)
#   bash scaling_benchmarks/device_batch.sh runtime   # dispatcher GPU tests + launch_overhead (~2 min)
#   bash scaling_benchmarks/device_batch.sh single    # single_device benchmark vs FLA (~6 min)
#   bash scaling_benchmarks/device_batch.sh comm      # state_passing, 2 GPUs           (~2 min)
#   bash scaling_benchmarks/device_batch.sh scaling   # weak_scaling quick + cost model (~6 min)
#   bash scaling_benchmarks/device_batch.sh train     # MQAR SP=1 vs SP=2               (~5 min)
#   bash scaling_benchmarks/device_batch.sh ws4       # 4 x H200: weak scaling fwd at 4 GPUs,
#                                                     #   state passing at 4 GPUs (~8 min)
#   bash scaling_benchmarks/device_batch.sh ws2       # weak scaling fwd at 2 GPUs, B=4   (~3 min)
#   bash scaling_benchmarks/device_batch.sh segtests  # GPU tests of the kept segment states
#   bash scaling_benchmarks/device_batch.sh long      # longest GDN layer sequence, 2 GPUs (~3 min)
#   bash scaling_benchmarks/device_batch.sh bwd       # Triton backward on one GPU: GPU tests,
#                                                     #   fwdbwd vs FLA, DSL-lowered gdn/hgrn (~9 min)
#   bash scaling_benchmarks/device_batch.sh wsbwd     # weak scaling fwdbwd at 2 GPUs (~3 min)
#   bash scaling_benchmarks/device_batch.sh tuned     # gla kernel tests, per-kernel profile and
#                                                     #   tile sweep, single-device fwd (~6 min)
#   bash scaling_benchmarks/device_batch.sh sp2       # 2 GPUs after a forge/runner change: forge
#                                                     #   tests, state passing, GDN/hgrn weak scaling fwd (~9 min)
#   bash scaling_benchmarks/device_batch.sh sp2c      # 2 GPUs: matrix-op weak scaling fwd, longest GDN (~9 min)
#   bash scaling_benchmarks/device_batch.sh sp2b      # 2 GPUs: weak scaling fwdbwd, lasp2 + forge (~6 min)
#   bash scaling_benchmarks/device_batch.sh sp2d      # 2 GPUs: forge tests, hgrn fwd scaling, longest GDN (~9 min)
#   bash scaling_benchmarks/device_batch.sh sp2e      # 2 GPUs: longest GDN, fwdbwd scaling (~9 min)
#   bash scaling_benchmarks/device_batch.sh sumbwd    # summary-backward GPU tests, scalar fwdbwd scaling (~5 min)
#   bash scaling_benchmarks/device_batch.sh robust    # 2 GPUs: forge load/faults/determinism, GPU numerics (~9 min)
#   bash scaling_benchmarks/device_batch.sh faults    # 2 GPUs: robust without the numerics; "rt": runtime tests + launch overhead
#   bash scaling_benchmarks/device_batch.sh graph     # 2 GPUs: 2 x 1000 CUDA-graph replays of a forge plan (~1 min)
#   bash scaling_benchmarks/device_batch.sh onegpu    # 1 GPU: summary-backward tests, runtime GPU
#                                                     #   tests, launch overhead, GPU numerics (~8 min)
#   bash scaling_benchmarks/device_batch.sh rt2       # 2 GPUs: forge tests, runtime
#                                                     #   GPU tests, launch overhead (~9 min)
#   bash scaling_benchmarks/device_batch.sh prolog    # 1 GPU: prologue-kernel and gate-sum tests compiled,
#                                                     #   GPU runtime/ops tests, gate-sum sweep (~9 min)
#   bash scaling_benchmarks/device_batch.sh prologbench # 1 GPU: launch overhead, DSL prologues, short-T
#                                                     #   simple_gla/gdn fwd vs FLA (~8 min)
#   bash scaling_benchmarks/device_batch.sh trainstep # 1 GPU: delta-rule backward tests and the ops' short
#                                                     #   path compiled, training-call overhead (~9 min)
#   bash scaling_benchmarks/device_batch.sh trainstep-kernels # 1 GPU: the backward kernels' GPU tests (~3 min)
#   bash scaling_benchmarks/device_batch.sh trainhost-tests # 1 GPU: the specialised backward programs'
#                                                     #   and the ops' planned path's GPU tests (~5 min)
#   bash scaling_benchmarks/device_batch.sh sptrain   # 2 GPUs: sequence-parallel training checks,
#                                                     #   fwdbwd scaling of gdn, gla, hgrn (~8 min)
#   bash scaling_benchmarks/device_batch.sh spgdn     # 2 GPUs: the delta rule's sequence-parallel plan,
#                                                     #   hgrn's training: GPU checks, scaling (~10 min)
#   bash scaling_benchmarks/device_batch.sh sptune    # 2 GPUs: gdn summary-walk tiles, hgrn fwdbwd profile (~7 min)
#   bash scaling_benchmarks/device_batch.sh sp4       # 4 GPUs: the delta rule's plan, hgrn training (~5 min)
#   bash scaling_benchmarks/device_batch.sh spfinal   # 2 GPUs: plans checks, B=4 / 16K / gdn fwd scaling (~6 min)
#   bash scaling_benchmarks/device_batch.sh verify-mg # 2 GPUs: the multigpu suite MG_RUNS times in a row
#   bash scaling_benchmarks/device_batch.sh verify-gpu # 2 GPUs: the gpu suite split over the two
#                                                     #   cards, launch overhead here and at BASE (~9 min)
#   bash scaling_benchmarks/device_batch.sh verify-bench # 2 GPUs: single_device here and at BASE on
#                                                     #   card 0, layers and DSL variants on card 1 (~9 min)
#   bash scaling_benchmarks/device_batch.sh layers-sp # 2 GPUs: every layer sequence-parallel against one shard (~6 min)
#   bash scaling_benchmarks/device_batch.sh scan4     # 4 GPUs: the log-depth scan beside the chains,
#                                                     #   weak scaling fwd + fwdbwd (~8 min)
#   LAYERS="gdn gla" bash scaling_benchmarks/device_batch.sh layers # 1 GPU: layers against FLA's, one
#                                                     #   step each: per-kernel and host times (~9 min)
#   bash scaling_benchmarks/device_batch.sh hier4     # 4 GPUs as two simulated nodes of 2: the GPU checks of
#                                                     #   scan and hier, weak scaling beside forge (~9 min)
#   bash scaling_benchmarks/device_batch.sh hier2     # the same on 2 GPUs as two nodes of 1 (~9 min)
#   bash scaling_benchmarks/device_batch.sh scanprof  # 2 GPUs: where a 16K call's time goes under
#                                                     #   forge, scan and hier (host profile) (~4 min)
#   bash scaling_benchmarks/device_batch.sh prof16k   # 2 GPUs: forge's 16K forward per rank (Chrome traces,
#                                                     #   host profile), then the 16K cell (~5 min)
#   bash scaling_benchmarks/device_batch.sh keptplans # 2 GPUs: hgrn's sequence-parallel plan and scan's kept
#                                                     #   rounds: GPU checks, then hgrn fwd / 16K scan cells (~8 min)
#   bash scaling_benchmarks/device_batch.sh lo-base   # 1 GPU: launch_overhead at BASE, then here (~4 min)
#   bash scaling_benchmarks/device_batch.sh sd-base   # 1 GPU: single_device (SD_T) at BASE, then here (~4 min)
#   bash scaling_benchmarks/device_batch.sh epilogues  # 1 GPU: the DSL's epilogue kernels and
#                                                     #   residual form checked and timed (~9 min)
#   bash scaling_benchmarks/device_batch.sh sp-errors  # 2 GPUs: the layers' errors against fp32, the
#                                                     #   DSL catalogue sequence-parallel (~9 min)
#   bash scaling_benchmarks/device_batch.sh graphs     # 1 GPU: the layers as CUDA graphs, checked and
#                                                     #   timed beside FLA's (~10 min)
#   bash scaling_benchmarks/device_batch.sh pieces-dsl # 2 GPUs: the delta rule's summary pieces checked
#                                                     #   on GPUs, the newly lowered DSL entries (~9 min)
#   OP=hgrn TOKENS=32768 bash scaling_benchmarks/device_batch.sh spprof # 2 GPUs: traces and host
#                                                     #   profile of one op's sequence-parallel call (~4 min)
#   bash scaling_benchmarks/device_batch.sh hgrn-verify # 2 GPUs: hgrn's GPU checks as they stand (~7 min)
#   bash scaling_benchmarks/device_batch.sh fla-verify  # 2 GPUs: FLA's models, generate and the
#                                                     #   two-rank prefill, first configurations (~9 min)
#   OP=hgrn MODE=fwd TOKENS=32768 TAG=t STRATEGIES=forge,serial bash scaling_benchmarks/device_batch.sh wscell
#                                                     # 2 GPUs: one weak-scaling cell (LIMIT s, B)
#   NAME=x LIMIT=300 PYTEST_ARGS="-m gpu tests/nn -k 'gdn or gla'" bash scaling_benchmarks/device_batch.sh pytest
#                                                     # any pytest selection as one step
#   (REAP=0: leave other jobs' workers alone, for a stage beside another on other cards;
#    KEPT_CHECKS=0 / KEPT_WS=0: keptplans without its GPU checks / its cells)
#   bash scaling_benchmarks/device_batch.sh suite4    # 4 GPUs: every gpu test at one commit, one share
#                                                     #   per card (~9 min)
#   bash scaling_benchmarks/device_batch.sh mg4       # 4 GPUs: the multigpu suite on cards 0-1, FLA's
#                                                     #   two-rank prefill on cards 2-3 (~8 min)
#   bash scaling_benchmarks/device_batch.sh leanscan  # 2 or 4 GPUs: scan's GPU checks, 16K forward under
#                                                     #   forge, scan, hier, lasp2 at 2 (and 4) ranks (~8 min)
#   MG_TESTS=f GPU_TESTS=f bash scaling_benchmarks/device_batch.sh leanscan4 # 4 GPUs: leanscan's checks
#                                                     #   beside the listed tests, then its 2-GPU cell (~9 min)
#   GPU_TESTS=f bash scaling_benchmarks/device_batch.sh shares # every card: a share of the node ids
#                                                     #   listed in f, dealt round-robin (GPU_LIMIT s)
#   bash scaling_benchmarks/device_batch.sh mqar4     # 4 GPUs: four MQAR configs of width 128, one a card,
#                                                     #   MQAR_LIMIT s each: which learns to 0.99 in 10 min
#   bash scaling_benchmarks/device_batch.sh sumtiles  # 1 GPU: simple_gla's summary walk at B=4, 32K over
#                                                     #   its tiles, its bandwidth on k and v (~3 min)
#   bash scaling_benchmarks/device_batch.sh fusedscan # 2 or 4 GPUs: scan's rounds in one launch: its GPU checks
#                                                     #   at every card, 16K fwd (and fwdbwd) beside forge (~8 min)
#   bash scaling_benchmarks/device_batch.sh stages3   # 4 GPUs: the B=4 cell at 2 ranks after the summary's third
#                                                     #   stage, its tests, its sweep at 2 and 3 stages (~5 min)
#   bash scaling_benchmarks/device_batch.sh abtiles   # 4 GPUs: simple_gla B=4 / 16K forward at 2 ranks with the
#                                                     #   summaries' tiles and the walk's; MQAR --sp 2 / --sp 1 (~9 min)
#   bash scaling_benchmarks/device_batch.sh final10   # 4 GPUs: the summary tiles' GPU tests and plans check,
#                                                     #   MQAR --sp 2 beside --sp 1 (~8 min)
#   bash scaling_benchmarks/device_batch.sh mqarab    # 4 GPUs: card 0 sumtiles; cards 1-3 MQAR with our kernels
#                                                     #   and with FORGE_DIST_KERNELS=torch (AB_LIMIT s)
#   bash scaling_benchmarks/device_batch.sh verify4   # 4 GPUs: cards 0-1 the multigpu suite (as verify-mg),
#                                                     #   card 2 the gpu kernel tests, card 3 the other gpu tests
#     (BASE: a tree of an earlier commit unpacked at ./_base, e.g. git archive 0303e10 | tar -x -C _base;
#      pass BASE_COMMIT=0303e10 so its results files name it)
#   bash scaling_benchmarks/device_batch.sh trainhost-bench # 1 GPU: training-call overhead, launch
#                                                     #   overhead (~6 min)
# Several stages run in order: device_batch.sh kernels single runtime
#
# Every step has a timeout (spin-waits can hang) and tees its log into $OUT; a step that
# fails does not stop the next one.  Copy what comes back into scaling_benchmarks/results/.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FORGE_DIST_TEST_INSTAFAIL=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FORGE_DIST_COMMIT="${FORGE_DIST_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
unset TRITON_INTERPRET
# compiled kernels stay in the (ignored) tree, so a second call on a warm machine skips the cold compile
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton_cache}"
for st in "$@"; do
  case "$st" in tests|kernels|runtime|single|comm|scaling|train|ws4|ws2|segtests|long|bwd|wsbwd|tuned|sp2|sp2b|sp2c|sp2d|sp2e|sumbwd|robust|faults|graph|rt|rt2|onegpu|prolog|prologbench|trainstep|trainstep-kernels|trainhost-tests|trainhost-bench|sptrain|spgdn|sptune|sp4|spfinal|verify-mg|verify-gpu|verify-bench|layers-sp|verify4|layers|scan4|hier4|hier2|scanprof|prof16k|keptplans|pytest|lo-base|sd-base|spprof|wscell|hgrn-verify|fla-verify|suite4|mg4|leanscan|leanscan4|shares|mqar4|sumtiles|fusedscan|mqarab|stages3|abtiles|final10|pieces-dsl|epilogues|sp-errors|graphs) ;; *) sed -n "2,/^# Every step/p" "$0"; exit 2 ;; esac
done
[ $# -gt 0 ] || { sed -n "2,/^# Every step/p" "$0"; exit 2; }
case " $* " in *" pytest "*) [ -n "${PYTEST_ARGS:-}" ] || { echo "pytest: set PYTEST_ARGS" >&2; exit 2; } ;; esac

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/batch.log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name rc=${PIPESTATUS[0]}" | tee -a "$OUT/batch.log"
}

reap() {  # workers that a timed-out step left behind (torchrun starts its own sessions);
  # REAP=0 where another job runs on the other cards (pkill does not know whose workers they are)
  [ "${REAP:-1}" = 1 ] || return 0
  pkill -9 -f "tests/comm/multigpu_worker.py|tests/sp/kernel_path_worker.py|torch.distributed.run|bin/torchrun|weak_scaling.py|launch/train.py|scaling_benchmarks/layers.py|scaling_benchmarks.dsl_variants" 2>/dev/null
  sleep 2
}

mg_runs() {  # the multigpu suite of the robustness issue's item 9, runs MG_FIRST..MG_RUNS in a row
  for i in $(seq "${MG_FIRST:-1}" "${MG_RUNS:-1}"); do
    step multigpu_run$i "${MG_LIMIT:-450}" python3 -m pytest -v -x -p no:cacheprovider \
      --durations=30 -m multigpu tests/sp tests/robustness/test_forge_gpu.py tests/runtime/test_gpu.py
  done
}

ws() {  # ws NAME SECONDS RANKS OP MODE B TOKENS TAG [STRATEGIES]: one weak-scaling step
  step "$1" "$2" torchrun --nproc-per-node "$3" scaling_benchmarks/weak_scaling.py --set B="$6" \
    --set tokens_per_gpu="$7" --set state_pass=false --ops "$4" --modes "$5" \
    --strategies "${9:-forge,serial,lasp2}" --tag "$8" --out "$OUT" ${WS_EXTRA:-}
}

mqar_curves() {  # MQAR runs in $OUT/mqar_sp1 and $OUT/mqar_sp2: their logs and one plot (only
  # two folder levels come back from the device: the run folders go)
  for sp in 1 2; do cp "$OUT/mqar_sp$sp/log.jsonl" "$OUT/mqar_gpu_sp$sp.jsonl" 2>/dev/null; done
  step mqar_plot 60 python3 launch/train.py --plot "$OUT/mqar_gpu_sp1.jsonl" \
    "$OUT/mqar_gpu_sp2.jsonl" --plot-out "$OUT/mqar_gpu_sp1_vs_sp2.png"
  rm -rf "$OUT/mqar_sp1" "$OUT/mqar_sp2"
}

for stage in "$@"; do
case "$stage" in
  robust|faults)  # issue 9 on the GPU (-s: the worker's lines reach the log as they come)
    step forge_robust 300 env FORGE_DIST_REPORT_DIR="$OUT" python3 -m pytest -q -s -p no:cacheprovider \
      tests/robustness/test_forge_gpu.py
    [ "$stage" = faults ] || step numerics_gpu 200 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=8 \
      tests/robustness/test_numerics_gpu.py ;;
  graph)  # the forge plan inside CUDA graphs (issue 8)
    step forge_graph 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu.py -k forge_graph ;;
  onegpu)
    step gpu_summary_backward_tests 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
      tests/kernels/test_summary_backward.py tests/kernels/test_scalar_backward.py
    step gpu_runtime_tests 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime \
      tests/ops -k "not forge_graph"
    step launch_overhead 120 python3 scaling_benchmarks/launch_overhead.py --out "$OUT"
    step gpu_numerics 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
      tests/robustness/test_numerics_gpu.py ;;
  rt|rt2)
    step gpu_runtime_tests 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime -k "not forge_graph"
    step launch_overhead 100 python3 scaling_benchmarks/launch_overhead.py --out "$OUT" ;;&
  rt2)
    step forge_multigpu 240 python3 -m pytest -q -s -p no:cacheprovider tests/sp/test_forge_multigpu.py ;;
  kernels)
    step gpu_kernel_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels ;;
  prolog)  # generated prologue kernels; scalar gates summed in the walks at short T
    step prolog_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prologue.py \
      tests/dsl/test_codegen.py tests/kernels/test_kernels.py -k \
      "prologue or codegen or translated or gate_sum or raw_gates or forward_matches"
    step prolog_gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime \
      tests/ops tests/dsl -k "not forge_graph"
    step gate_sum 150 python3 scaling_benchmarks/kernel_profile.py --ops simple_gla --T 4096 \
      --passes fwd --impls forge_dist --sweep gate_sum \
      --sweep-T 1024,2048,4096,8192,16384,32768,65536,262144 --tag gate-sum --out "$OUT" ;;
  prologbench)
    step launch_overhead 150 python3 scaling_benchmarks/launch_overhead.py --out "$OUT"
    step dsl_prologue 240 python3 scaling_benchmarks/dsl_prologue.py --out "$OUT"
    step single_short 240 python3 scaling_benchmarks/single_device.py --ops simple_gla,gated_delta_rule \
      --T 1024,4096,16384 --passes fwd --no-dsl --tag short --out "$OUT" ;;
  trainstep)  # the ops' training calls through plans (forward + planned backward)
    step delta_backward_tests 220 python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_delta_backward.py
    step planned_tests 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_planned.py
    step train_overhead 240 python3 scaling_benchmarks/train_overhead.py --out "$OUT" ;;
  trainstep-kernels)  # the backward kernels' GPU tests and the runtime's
    step backward_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_scalar_backward.py tests/kernels/test_vector_backward.py \
      tests/kernels/test_delta_backward.py tests/runtime/test_gpu.py ;;
  trainhost-tests)  # the backward programs' straight-line runs (fastpath.specialise_program)
    step backward_program_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/runtime/test_gpu.py -k "backward or relaunch or static_equals"
    step planned_tests 220 python3 -m pytest -q -p no:cacheprovider tests/ops/test_planned.py ;;
  trainhost-bench)
    step train_overhead 300 python3 scaling_benchmarks/train_overhead.py --out "$OUT" \
      ${TRAIN_TAG:+--tag "$TRAIN_TAG"}
    step launch_overhead 200 python3 scaling_benchmarks/launch_overhead.py --repeats 3 \
      --out "$OUT" ${TRAIN_TAG:+--tag "$TRAIN_TAG"} ;;
  runtime)
    step gpu_runtime_tests 180 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/runtime
    step launch_overhead 150 python3 scaling_benchmarks/launch_overhead.py --out "$OUT" ;;
  verify-mg)  # the suite of the robustness issue's item 9, runs MG_FIRST..MG_RUNS in a row, then
    # FLA's models with MG_NN=1.  A cold run compiles every kernel: on 2 x H100 (2026-11-27)
    # neither of two cold runs passed its first test (which runs all 19 forge cases) in 170 s;
    # the third, warm, did 79 tests in 170 s.
    mg_runs
    [ "${MG_NN:-0}" = 1 ] && step multigpu_nn 200 python3 -m pytest -v -p no:cacheprovider \
      -m multigpu tests/nn ;;
  verify-gpu)  # every gpu test, the two cards in parallel; then launch overhead alone, BASE first
    ( export CUDA_VISIBLE_DEVICES=0; step gpu_kernels 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/kernels > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=1; step gpu_rest 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests --ignore=tests/kernels > /dev/null ) &
    wait
    if [ -d _base ]; then
      step launch_overhead_base 100 env PYTHONPATH="$PWD/_base:/tmp/site" FORGE_DIST_COMMIT="${BASE_COMMIT:-base}" \
        python3 _base/scaling_benchmarks/launch_overhead.py --repeats 3 --cache-dir /tmp/aot_base --out "$OUT/base" --tag base
    fi
    step launch_overhead_head 100 python3 scaling_benchmarks/launch_overhead.py --repeats 3 \
      --cache-dir /tmp/aot_head --out "$OUT" --tag head ;;
  verify-bench)  # card 0: single_device at BASE, then here (same card); card 1: layers, DSL variants
    sd_args=(--T 4096,16384,65536 --no-dsl --sweep "" --impls forge_dist/auto,ops)
    ( export CUDA_VISIBLE_DEVICES=0
      if [ -d _base ]; then
        step single_base 240 env PYTHONPATH="$PWD/_base:/tmp/site" FORGE_DIST_COMMIT="${BASE_COMMIT:-base}" \
          python3 _base/scaling_benchmarks/single_device.py "${sd_args[@]}" --out "$OUT/base" --tag base > /dev/null
      fi
      step single_head 240 python3 scaling_benchmarks/single_device.py "${sd_args[@]}" --out "$OUT" \
        --tag head > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=1
      step layers 330 python3 scaling_benchmarks/layers.py --out "$OUT" > /dev/null
      step dsl_variants 200 python3 -m scaling_benchmarks.dsl_variants --budget-s 170 --out "$OUT" \
        > /dev/null ) &
    wait ;;
  suite4)  # a 4-GPU machine: every gpu-marked test at one commit, one share per card (the
    # FLA models at their autotuners' first configurations); mg4 runs the multigpu ones
    export FORGE_DIST_TEST_FIRST_CONFIG=1
    g() { step "$1" "${GPU_LIMIT:-560}" python3 -m pytest -v -p no:cacheprovider --durations=15 -m gpu "${@:2}"; }
    ( export CUDA_VISIBLE_DEVICES=0; g gpu_kernels tests/robustness/test_numerics_gpu.py tests/kernels > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=1; g gpu_nn tests/nn > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=2; g gpu_runtime_ops tests/runtime tests/ops/test_ops_gpu.py > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=3; g gpu_planned_dsl tests/ops/test_planned.py tests/dsl > /dev/null ) &
    wait ;;
  shares)  # the gpu tests listed in GPU_TESTS (node ids, one a line), dealt round-robin to
    # the visible cards, one pytest per card (FLA's models at their first configurations)
    export FORGE_DIST_TEST_FIRST_CONFIG=1
    cards=$(nvidia-smi -L | wc -l)  # every card of the machine (not CUDA_VISIBLE_DEVICES)
    for c in $(seq 0 $((cards - 1))); do
      awk -v n="$cards" -v c="$c" 'NF && (NR - 1) % n == c' \
        "${GPU_TESTS:?shares: set GPU_TESTS to a file of node ids}" > "$OUT/share$c.txt"
      [ -s "$OUT/share$c.txt" ] || continue  # fewer tests than cards: nothing for this one
      ( export CUDA_VISIBLE_DEVICES=$c; step gpu_share$c "${GPU_LIMIT:-560}" python3 -m pytest -v \
          -p no:cacheprovider --durations=10 $(cat "$OUT/share$c.txt") > /dev/null ) &
    done
    wait ;;
  mg4)  # a 4-GPU machine: the multigpu suite on cards 0-1 while cards 2-3 run FLA's models'
    # two-rank prefill then decoding (the two jobs share nothing but the host)
    ( export CUDA_VISIBLE_DEVICES=0,1; mg_runs > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=2,3; step fla_sp_prefill "${MG_LIMIT:-450}" env FORGE_DIST_TEST_FIRST_CONFIG=1 \
        python3 -m pytest -v -p no:cacheprovider -m multigpu tests/nn/test_fla_models_gpu.py > /dev/null ) &
    wait
    reap ;;
  verify4)  # a 4-GPU machine: the multigpu suite on one pair while the other two cards run the
    # gpu suite (the two jobs share nothing: separate processes, ports and NVSHMEM worlds)
    ( export CUDA_VISIBLE_DEVICES=0,1; mg_runs > /dev/null ) &
    # (card 2 starts with the GPU numerics, hard resets among them, then the kernels)
    ( export CUDA_VISIBLE_DEVICES=2; step gpu_kernels "${GPU_LIMIT:-540}" python3 -m pytest -v \
        -p no:cacheprovider --durations=20 -m gpu tests/robustness/test_numerics_gpu.py \
        tests/kernels > /dev/null ) &
    ( export CUDA_VISIBLE_DEVICES=3; step gpu_rest "${GPU_LIMIT:-540}" python3 -m pytest -v \
        -p no:cacheprovider --durations=20 -m gpu tests --ignore=tests/kernels \
        --deselect tests/robustness/test_numerics_gpu.py > /dev/null ) &
    wait
    reap ;;
  hier4|hier2)  # the scaling issue: hier on two simulated nodes (FORGE_DIST_RANKS_PER_NODE): its
    # GPU checks and scan's, then weak scaling beside the chain, scan and lasp2
    P=${stage#hier}
    reap
    checks=available,no_host_sync_hier
    for k in identity scalar diagonal dense; do checks+=,scan_chains_$k,hier_chains_$k; done
    for o in simple_gla gated_delta_rule; do checks+=,scan_op_$o,hier_op_$o; done
    step hier${P}_checks "${CHECKS_LIMIT:-260}" env FORGE_MG_WORLD=$P FORGE_DIST_RANKS_PER_NODE=$((P / 2)) \
      FORGE_MG_CHECKS=$checks python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py
    reap
    export FORGE_DIST_RANKS_PER_NODE=$((P / 2))
    ws hier${P}_16k 110 $P simple_gla fwd 1 16384 b1h32-16k-hier${TAG_SUFFIX:-} ${WS_STRATEGIES:-forge,serial,lasp2,scan,hier}
    WS_EXTRA="--set fla_cp=false" ws hier${P}_gdn 100 $P gated_delta_rule fwd 1 32768 \
      b1h32-32k-gdn-hier${TAG_SUFFIX:-} forge,scan,hier
    [ "${HIER_BWD:-1}" = 1 ] && ws hier${P}_bwd 100 $P simple_gla fwdbwd 1 32768 \
      b1h32-32k-fwdbwd-hier${TAG_SUFFIX:-} forge,scan,hier
    unset FORGE_DIST_RANKS_PER_NODE
    reap ;;
  layers-sp)  # the layers' issue: each layer with forge on 2 GPUs against its shard alone
    # (LAYERS, default all; the 2026-11-27 file ran gdn,gla,simple_gla,hgrn with --repeats 10)
    step layers_sp 420 torchrun --nproc-per-node 2 scaling_benchmarks/layers.py --sp \
      --layers "${LAYERS:-gdn,gla,retnet,simple_gla,hgrn,linear_attn,mamba2,lightning}" \
      --repeats "${REPEATS:-10}" --out "$OUT" ;;
  leanscan)  # the scaling issue, after scan's lean first send (rank 0 sends its program's
    # summary with nothing ahead of it): GPU checks on 2 ranks, then simple_gla's 16K forward
    # under forge, scan, hier and lasp2 on 2 GPUs (hier as two one-GPU nodes) and, on a
    # machine of 4, on 4 (two nodes of two) with the chain's serial too
    reap
    step leanscan_checks "${CHECKS_LIMIT:-300}" env CUDA_VISIBLE_DEVICES=0,1 \
      FORGE_MG_CHECKS=available,plans,no_host_sync_scan,no_host_sync_hier,scan_op_simple_gla,hier_op_simple_gla,scan_op_hgrn \
      python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py
    reap
    FORGE_DIST_RANKS_PER_NODE=1 ws leanscan_16k_ws2 150 2 simple_gla fwd 1 16384 \
      b1h32-16k-leanscan forge,scan,hier,lasp2
    if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
      FORGE_DIST_RANKS_PER_NODE=2 ws leanscan_16k_ws4 180 4 simple_gla fwd 1 16384 \
        b1h32-16k-leanscan forge,scan,hier,lasp2,serial
      WS_EXTRA="--set fla_cp=false" ws leanscan_gdn_ws4 150 4 gated_delta_rule fwd 1 32768 \
        b1h32-32k-gdn-leanscan forge,scan,lasp2
    fi
    reap ;;
  leanscan4)  # a 4-GPU machine: leanscan's GPU checks on cards 2-3 while cards 0-1 run the
    # multigpu tests named in MG_TESTS (a file of node ids, e.g. what an earlier stage's
    # limit cut off) and then card 2 the gpu tests in GPU_TESTS; then the 16K cells alone
    if [ -n "${MG_TESTS:-}" ]; then
      ( export CUDA_VISIBLE_DEVICES=0,1; step mg_rest "${MG_LIMIT:-330}" python3 -m pytest -v \
          -p no:cacheprovider --durations=10 $(cat "$MG_TESTS") > /dev/null ) &
    fi
    ( export CUDA_VISIBLE_DEVICES=2,3
      step leanscan_checks "${CHECKS_LIMIT:-240}" env \
        FORGE_MG_CHECKS=available,plans,no_host_sync_scan,no_host_sync_hier,scan_op_simple_gla,hier_op_simple_gla,scan_op_hgrn \
        python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py > /dev/null
      if [ -n "${GPU_TESTS:-}" ]; then
        CUDA_VISIBLE_DEVICES=2 step gpu_rest "${GPU_LIMIT:-90}" python3 -m pytest -v \
          -p no:cacheprovider $(cat "$GPU_TESTS") > /dev/null
      fi ) &
    wait
    reap
    FORGE_DIST_RANKS_PER_NODE=1 ws leanscan_16k_ws2 150 2 simple_gla fwd 1 16384 \
      b1h32-16k-leanscan forge,scan,hier,lasp2
    reap ;;
  scan4)  # the scaling issue: scan (log2 P rounds) against the chains and lasp2 at 4 GPUs
    ws scan4_16k 200 4 simple_gla fwd 1 16384 b1h32-16k-scan forge,serial,lasp2,scan
    ws scan4_gdn 200 4 gated_delta_rule fwd 1 32768 b1h32-32k-gdn-scan forge,serial,lasp2,scan
    ws scan4_bwd 160 4 simple_gla fwdbwd 1 32768 b1h32-32k-fwdbwd-scan forge,serial,lasp2,scan ;;
  scanprof)  # the scaling issue: scan's 16K forward costs 0.3-0.5 ms more than forge's
    # (2026-11-27): host time per call, GPU time and kernels, and the host's own profile
    reap
    FORGE_DIST_RANKS_PER_NODE=1 step scanprof 240 torchrun --nproc-per-node 2 \
      scaling_benchmarks/sp_profile.py --op simple_gla --tokens 16384 \
      --strategies forge,scan,hier --host-profile 200 --out "$OUT"
    reap ;;
  prof16k)  # the scaling issue: forge's 16K forward is 1.29-1.41x its shard on H100s and
    # 1.05-1.35x on H200s from run to run: each rank's kernels in time (traces), then the cell
    reap
    step prof16k 200 torchrun --nproc-per-node 2 scaling_benchmarks/sp_profile.py --op simple_gla \
      --tokens 16384 --strategies forge --trace --host-profile 100 --out "$OUT"
    reap
    ws prof16k_ws 150 2 simple_gla fwd 1 16384 b1h32-16k-prof forge,serial,lasp2,auto
    reap ;;
  keptplans)  # the scaling issue (2026-11-27, fifth session): hgrn's forward with a group on
    # its plan, scan's and hier's plans keeping their rounds; their GPU checks, then the cells
    reap
    [ "${KEPT_CHECKS:-1}" = 1 ] && step keptplans_checks "${CHECKS_LIMIT:-260}" env FORGE_MG_CHECKS=available,plans,op_hgrn,no_host_sync_forge,no_host_sync_scan,scan_op_simple_gla,hier_op_simple_gla,no_host_sync_hier \
      python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py
    reap
    [ "${KEPT_WS:-1}" = 1 ] || continue  # KEPT_WS=0: the checks alone
    ws keptplans_hgrn 100 2 hgrn fwd 1 32768 b1h32-32k-hgrn-plan forge,serial,lasp2,scan
    FORGE_DIST_RANKS_PER_NODE=1 ws keptplans_16k 110 2 simple_gla fwd 1 16384 b1h32-16k-kept \
      forge,lasp2,scan,hier
    reap ;;
  lo-base|sd-base)  # the architecture issue's no-regression check on this card: launch_overhead
    # (lo-base) or single_device (sd-base, SD_T) at BASE (./_base), then here; tags TAG-base / TAG-head
    t=${TAG:-rerun}
    if [ "$stage" = lo-base ]; then
      step lo_base 110 env PYTHONPATH="$PWD/_base:/tmp/site" FORGE_DIST_COMMIT="${BASE_COMMIT:-base}" \
        python3 _base/scaling_benchmarks/launch_overhead.py --repeats 3 --cache-dir /tmp/aot_base \
        --out "$OUT" --tag "$t-base"
      step lo_head 110 python3 scaling_benchmarks/launch_overhead.py --repeats 3 \
        --cache-dir /tmp/aot_head --out "$OUT" --tag "$t-head"
    else
      sd_args=(--T "${SD_T:-4096,16384}" --no-dsl --sweep "" --impls forge_dist/auto,ops)
      step sd_base 120 env PYTHONPATH="$PWD/_base:/tmp/site" FORGE_DIST_COMMIT="${BASE_COMMIT:-base}" \
        python3 _base/scaling_benchmarks/single_device.py "${sd_args[@]}" --out "$OUT" --tag "$t-base"
      step sd_head 120 python3 scaling_benchmarks/single_device.py "${sd_args[@]}" --out "$OUT" \
        --tag "$t-head"
    fi ;;
  spprof)  # NPROC GPUs (2): one op's sequence-parallel call per rank (Chrome traces, host profile):
    # OP (simple_gla), TOKENS (16384), STRATEGIES (forge), e.g. OP=hgrn TOKENS=32768;
    # GRAD=1: the call with gradients and its backward (the fwdbwd rows' call)
    reap
    grad=(); [ "${GRAD:-0}" = 1 ] && grad=(--grad)
    step "spprof_${OP:-simple_gla}${grad:+_grad}" 240 torchrun --nproc-per-node "${NPROC:-2}" \
      scaling_benchmarks/sp_profile.py --op "${OP:-simple_gla}" --tokens "${TOKENS:-16384}" \
      --strategies "${STRATEGIES:-forge}" "${grad[@]}" --trace --host-profile 100 --out "$OUT"
    reap ;;
  hgrn-verify)  # 2 GPUs: the seventh session's GPU checks as they now stand (slow hgrn decays,
    # the plans' autograd nodes asserted, forge against serial to 1e-3), not yet run
    reap
    step hgrn_checks "${CHECKS_LIMIT:-420}" env FORGE_MG_CHECKS=available,hgrn_mixed,op_hgrn,scan_op_hgrn,hier_op_hgrn,no_host_sync_forge \
      python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py
    reap ;;
  fla-verify)  # 2 GPUs: FLA's models, generate's near-tie rule (one card) and the two-rank
    # prefill then decoding (both cards), every autotuned kernel at its first configuration
    # (generate on the first visible card)
    step fla_generate 240 env FORGE_DIST_TEST_FIRST_CONFIG=1 \
      CUDA_VISIBLE_DEVICES="$(echo "${CUDA_VISIBLE_DEVICES:-0}" | cut -d, -f1)" python3 -m pytest \
      -v -s -p no:cacheprovider -m gpu tests/nn/test_fla_models_gpu.py -k generates
    reap
    step fla_sp_prefill 330 env FORGE_DIST_TEST_FIRST_CONFIG=1 python3 -m pytest -v \
      -p no:cacheprovider -m multigpu tests/nn/test_fla_models_gpu.py
    reap ;;
  pieces-dsl)  # 2 GPUs, after the thirteenth session: the delta rule's summary pieces on the
    # side stream (plans_delta and the CUDA-graph test force 4 pieces), then one card: the DSL
    # entries that newly lower (and the new generated one) compiled, against the built-ins
    reap
    step pieces_checks 330 env FORGE_MG_CHECKS=available,plans_delta,no_host_sync_forge \
      python3 -m pytest -v -p no:cacheprovider -m multigpu tests/sp/test_forge_multigpu.py
    reap
    step pieces_graph 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu.py -k forge_graph
    reap
    ( export CUDA_VISIBLE_DEVICES="$(echo "${CUDA_VISIBLE_DEVICES:-0}" | cut -d, -f1)"
      step dsl_new_gpu 240 python3 -m pytest -v -p no:cacheprovider -m gpu \
        tests/dsl/test_catalogue.py -k "rg_lru or hgrn_softmax_gate or second_decay"
      step dsl_new_bench 240 python3 -m scaling_benchmarks.dsl_variants --budget-s 200 \
        --variants rg_lru,second_decay,input_gate,output_gate_linear,deltanet_two_rates,hgrn_softmax_gate \
        --out "$OUT" --tag s13-new ) ;;
  epilogues)  # 1 GPU, after the fifteenth session: the DSL's epilogues as generated kernels
    # (output gates, Mamba2's skip term), the residual form (a strict readout on simple_gla, a
    # current-token bonus on the delta rule; Inductor) and the delta rule's strict readout on
    # the generated path, checked on CUDA against fp64, then timed against the built-ins
    ( export CUDA_VISIBLE_DEVICES="$(echo "${CUDA_VISIBLE_DEVICES:-0}" | cut -d, -f1)"
      step dsl_epilogue_gpu 240 python3 -m pytest -v -p no:cacheprovider -m gpu \
        tests/dsl/test_catalogue.py -k "output_gate or mamba2_d_skip or strict_readout or gated_delta_bonus"
      step dsl_epilogue_bench 300 python3 -m scaling_benchmarks.dsl_variants --budget-s 250 \
        --variants mamba2_d_skip,output_gate,output_gate_linear,gla_output_gate,gated_delta_output_gate,hgrn_output_gate,strict_readout,gated_delta_bonus,gated_delta_strict_readout \
        --out "$OUT" --tag s15-epilogues ) ;;
  graphs)  # 1 GPU, after the fifteenth session: every layer captured as CUDA graphs
    # (forge_dist.nn.graphed) against the eager layer, then timed beside FLA's and the eager
    # layer (carry .whl for FLA's rows); the lever for host-bound layers
    ( export CUDA_VISIBLE_DEVICES="$(echo "${CUDA_VISIBLE_DEVICES:-0}" | cut -d, -f1)"
      step graphed_gpu 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/nn/test_graphed_gpu.py
      step layers_graphed 330 python3 scaling_benchmarks/layers.py --graphed --no-breakdown \
        --layers "${LAYERS:-gdn,gla,hgrn,linear_attn,retnet}" --out "$OUT" --tag graphed ) ;;
  sp-errors)  # 2 GPUs, after the fifteenth session: the layers' bf16 gradient errors against
    # fp32 beside one GPU's, then the DSL catalogue sequence-parallel against one shard beside
    # its built-ins (issue 36's 2-rank target)
    if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
      echo "== sp-errors: skipped, it needs 2 GPUs" | tee -a "$OUT/batch.log"; continue
    fi
    reap
    step layers_sp_errors 270 torchrun --nproc-per-node 2 scaling_benchmarks/layers.py --sp \
      --layers "${LAYERS:-gdn,gla,linear_attn}" --passes fwdbwd --repeats 5 --out "$OUT" \
      --tag errors-fp32
    reap
    step dsl_sp 270 torchrun --nproc-per-node 2 -m scaling_benchmarks.dsl_variants --sp \
      --T 16384 --repeats 10 --out "$OUT" --tag s15-sp \
      --variants "${VARIANTS:-gate_named_a,relu_pow2,input_gate,output_gate,mamba2_d_skip,strict_readout,gla_gate_gk,gated_delta_a_b,gated_delta_bonus,hgrn_u_f}"
    reap ;;
  wscell)  # 2 GPUs: one weak-scaling cell, OP MODE (fwd or fwdbwd) B TOKENS TAG STRATEGIES LIMIT,
    # e.g. OP=hgrn MODE=fwd TOKENS=32768 TAG=b1h32-32k-hgrn
    reap
    ws "ws_${OP:-simple_gla}_${MODE:-fwd}" "${LIMIT:-150}" 2 "${OP:-simple_gla}" "${MODE:-fwd}" \
      "${B:-1}" "${TOKENS:-16384}" "${TAG:-cell}" "${STRATEGIES:-forge,serial,lasp2}"
    reap ;;
  pytest)  # one pytest selection (PYTEST_ARGS, shell words: quotes group) as a step named
    # NAME, LIMIT seconds
    eval "pa=($PYTEST_ARGS)"
    step "${NAME:-pytest}" "${LIMIT:-300}" python3 -m pytest -v -p no:cacheprovider --durations=20 \
      "${pa[@]}" ;;
  layers)  # layers against FLA's on one GPU, one step (and one results file) per layer, with
    # the per-kernel breakdown and host time of ours; LAYERS (default the five that fit one
    # call), PASSES, LAYER_LIMIT s per layer
    for l in ${LAYERS:-gdn gla retnet hgrn linear_attn}; do
      step "layers_$l" "${LAYER_LIMIT:-100}" python3 scaling_benchmarks/layers.py --layers "$l" \
        --passes "${PASSES:-fwd,fwdbwd}" --kernels 5 --rep 30 --out "$OUT" --tag "$l"
    done ;;
  tests)
    step gpu_tests 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests ;;
  single)
    step single_device 540 python3 scaling_benchmarks/single_device.py --out "$OUT" ;;
  comm)
    step state_passing 240 torchrun --nproc_per_node 2 scaling_benchmarks/state_passing.py \
      --out "$OUT" ;;
  scaling)
    step weak_scaling 420 bash launch/torchrun.sh --nproc-per-node 2 \
      scaling_benchmarks/weak_scaling.py --config configs/weak_scaling_2gpu_quick.toml --out "$OUT"
    step cost_model 90 sh -c "python3 scaling_benchmarks/cost_model.py --config configs/cost_model.toml --calibrate $OUT/weak_scaling_*.json $OUT/state_passing_*.json --out $OUT" ;;
  segtests)
    step gpu_segment_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels \
      -k "reuses or composes or segments or real_shapes" ;;
  ws4)  # forward, the design shape (docs/design.md section 10) (B=4, 32K tokens per GPU), every op x strategy
    step weak_scaling_4gpu 330 bash launch/torchrun.sh --nproc-per-node 4 \
      scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'passes=["fwd"]' --set warmup=1 --set repeats=3 --out "$OUT"
    step state_passing_4gpu 150 torchrun --nproc_per_node 4 scaling_benchmarks/state_passing.py \
      --out "$OUT" --iters 20 ;;
  bwd)  # the Triton backward of every pattern: correctness at real shapes, then timings
    step gpu_backward_tests 190 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_scalar_backward.py tests/kernels/test_vector_backward.py \
      tests/kernels/test_delta_backward.py tests/kernels/test_vector_state_backward.py
    step single_fwdbwd 240 python3 scaling_benchmarks/single_device.py --out "$OUT" \
      --passes fwdbwd --impls forge_dist/auto,fla --T 4096,16384,65536 --tag fwdbwd
    step single_dsl 130 python3 scaling_benchmarks/single_device.py --out "$OUT" \
      --ops gated_delta_rule,hgrn --passes fwd --impls forge_dist/auto,forge_dsl \
      --T 4096,65536 --tag dsl-lowered ;;
  tuned)  # after a kernel or tile change: its tests compiled, where the time goes, the rows
    step gla_kernel_tests 150 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_kernels.py tests/kernels/test_vector_backward.py -k gla
    step kernel_profile 100 env CUDA_VISIBLE_DEVICES=0 python3 scaling_benchmarks/kernel_profile.py \
      --ops gla,gated_delta_rule,hgrn --passes fwd --T 16384 --sweep gla --tag tuned --out "$OUT"
    step single_fwd 170 env CUDA_VISIBLE_DEVICES=0 python3 scaling_benchmarks/single_device.py \
      --out "$OUT" --passes fwd --impls forge_dist/auto,fla --T 4096,16384,65536 --no-dsl \
      --tag fwd-tuned ;;
  wsbwd)  # 2 GPUs: forward + backward, every strategy's backward through the Triton kernels
    step weak_scaling_2gpu_fwdbwd 150 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["gla","gated_delta_rule","hgrn"]' --set 'passes=["fwdbwd"]' \
      --set 'strategies=["lasp2","forge"]' --set warmup=1 --set repeats=3 \
      --set state_pass=false --out "$OUT" ;;
  ws2)  # 2 GPUs, B=4: fwd+fwdbwd where the backward is Triton (scalar decay) or cheap (hgrn)
    step weak_scaling_2gpu 170 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["linear_attn","simple_gla","hgrn"]' --set warmup=1 --set repeats=3 \
      --set state_pass=false --out "$OUT"
    mv "$OUT"/weak_scaling_*.json "$OUT/ws2_scalar.json" 2>/dev/null
    step weak_scaling_2gpu_b 150 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["gla","gated_delta_rule"]' --set 'passes=["fwd"]' \
      --set 'strategies=["lasp2","forge"]' --set warmup=1 --set repeats=3 --out "$OUT" ;;
  sp2)  # 2 GPUs: the forge kernel on real NVSHMEM, the inter-rank phase alone, then the
        # forward of the ops with a dense (GDN) or vector (hgrn) state at the design shape (docs/design.md section 10)
    step forge_multigpu_tests 300 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/sp/test_forge_multigpu.py
    step state_passing 130 torchrun --nproc_per_node 2 scaling_benchmarks/state_passing.py \
      --out "$OUT" --iters 20
    step weak_scaling_2gpu_fwd_gdn_hgrn 240 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["gated_delta_rule","hgrn"]' --set 'passes=["fwd"]' --set warmup=1 \
      --set repeats=3 --set state_pass=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwd-gdn-hgrn.json"; done ;;
  sp2c)  # 2 GPUs: forward of the matrix-state ops (B=4, 32K tokens per GPU), longest GDN layer
    step weak_scaling_2gpu_fwd_matrix 300 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["linear_attn","simple_gla","gla"]' --set 'passes=["fwd"]' --set warmup=1 \
      --set repeats=3 --set state_pass=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwd-matrix.json"; done
    step long_sequence 200 torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py \
      --out "$OUT" --lengths 1M 2M 4M --set timeout_s=60 ;;
  sp2b)  # 2 GPUs: forward+backward of every op (lasp2 and forge)
    step weak_scaling_2gpu_fwdbwd 330 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'passes=["fwdbwd"]' --set 'strategies=["lasp2","forge"]' --set warmup=1 \
      --set repeats=3 --set state_pass=false --set fla_cp=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwdbwd.json"; done ;;
  sp2d)  # 2 GPUs: forge tests on real NVSHMEM, hgrn forward scaling, the longest GDN layer
    step forge_multigpu_tests 300 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/sp/test_forge_multigpu.py
    step weak_scaling_2gpu_fwd_hgrn 70 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["hgrn"]' --set 'passes=["fwd"]' --set 'strategies=["lasp2","forge"]' \
      --set warmup=1 --set repeats=3 --set state_pass=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwd-hgrn.json"; done
    step long_sequence 190 torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py \
      --out "$OUT" --lengths 1M 2M 4M --set timeout_s=60 ;;
  sp2e)  # 2 GPUs: the longest GDN layer, then forward+backward scaling (lasp2, forge), GDN first
    step long_sequence 150 torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py \
      --out "$OUT" --lengths 2M 4M --set timeout_s=60
    step weak_scaling_2gpu_fwdbwd 390 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["gated_delta_rule","hgrn","linear_attn","simple_gla","gla"]' \
      --set 'passes=["fwdbwd"]' --set 'strategies=["lasp2","forge"]' --set warmup=1 \
      --set repeats=3 --set state_pass=false --set fla_cp=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwdbwd.json"; done ;;
  sumbwd)  # 2 GPUs, after a summary-backward change: its GPU tests, scalar-decay fwdbwd scaling
    step gpu_summary_backward_tests 100 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q \
      -p no:cacheprovider -m gpu tests/kernels/test_summary_backward.py \
      tests/kernels/test_scalar_backward.py
    step weak_scaling_2gpu_fwdbwd_scalar 170 env CUDA_VISIBLE_DEVICES=0,1 bash launch/torchrun.sh \
      --nproc-per-node 2 scaling_benchmarks/weak_scaling.py --config configs/weak_scaling.toml \
      --set 'ops=["linear_attn","simple_gla"]' --set 'passes=["fwdbwd"]' \
      --set 'strategies=["lasp2","forge"]' --set warmup=1 --set repeats=3 \
      --set state_pass=false --set fla_cp=false --out "$OUT"
    for f in "$OUT"/weak_scaling_*_ws2.json; do [ -e "$f" ] && mv "$f" "${f%.json}_fwdbwd-scalar.json"; done ;;
  sptrain)  # 2 GPUs, after a change to sequence-parallel training (runtime/sp_train.py,
            # ops/shard_call.py): its GPU checks, then fwdbwd scaling one op per step
    step sp_training_checks 180 env FORGE_MG_CHECKS=op_gated_delta_rule,op_simple_gla,op_gla,no_host_sync_forge \
      python3 -m pytest -q -s -m multigpu tests/sp/test_forge_multigpu.py
    for op in gated_delta_rule:170 hgrn:110 gla:120; do
      ws "weak_scaling_fwdbwd_${op%%:*}" "${op##*:}" 2 "${op%%:*}" fwdbwd 1 32768 \
        "b1h32-32k-fwdbwd-${op%%:*}"
    done ;;
  spgdn)  # 2 GPUs, after the delta rule's sequence-parallel plan and hgrn's shard_call
          # training: their GPU checks, gdn fwd and hgrn fwdbwd scaling, the no-sync check
    step spgdn_checks 170 env FORGE_MG_CHECKS=plans_delta,op_hgrn,op_gated_delta_rule \
      python3 -m pytest -q -s -m multigpu tests/sp/test_forge_multigpu.py
    ws weak_scaling_fwd_gdn 130 2 gated_delta_rule fwd 1 32768 b1h32-32k-fwd-gdn-plan
    ws weak_scaling_fwdbwd_hgrn 110 2 hgrn fwdbwd 1 32768 b1h32-32k-fwdbwd-hgrn-split
    step no_host_sync_forge 170 env FORGE_MG_CHECKS=no_host_sync_forge \
      python3 -m pytest -q -s -m multigpu tests/sp/test_forge_multigpu.py ;;
  sptune)  # 2 GPUs: the delta rule's summary-walk tiles on the chain's critical path (gdn
           # forward scaling, forge, one run per tile config); hgrn fwdbwd host/GPU profile
    for tiles in default "BV=16,num_warps=2" "BV=16,num_warps=4" "BV=64,num_warps=4"; do
      tag=$(echo "$tiles" | tr -d ',=_' | tr 'A-Z' 'a-z')
      export FORGE_DIST_DENSE_SUMMARY_TILES="$([ "$tiles" = default ] || echo "$tiles")"
      ws "ws_fwd_gdn_$tag" 75 2 gated_delta_rule fwd 1 32768 "b1h32-32k-fwd-gdn-sum-$tag" forge
    done
    unset FORGE_DIST_DENSE_SUMMARY_TILES
    step sp_profile_hgrn 110 torchrun --nproc-per-node 2 \
      scaling_benchmarks/sp_profile.py --op hgrn --tokens 32768 --strategies forge --grad \
      --trace --out "$OUT" ;;
  sp4)  # 4 GPUs: the delta rule's plan and hgrn's training at 4 ranks (middle ranks walk the
        # dense transition from the identity): GPU checks, gdn forward and hgrn fwdbwd scaling
    step sp4_checks 130 env FORGE_MG_WORLD=4 FORGE_MG_CHECKS=plans_delta,op_hgrn \
      python3 -m pytest -q -s -m multigpu tests/sp/test_forge_multigpu.py
    ws weak_scaling_fwd_gdn_p4 100 4 gated_delta_rule fwd 1 32768 b1h32-32k-fwd-gdn-p4
    ws weak_scaling_fwdbwd_hgrn_p4 80 4 hgrn fwdbwd 1 32768 b1h32-32k-fwdbwd-hgrn-p4 ;;
  spfinal)  # 2 GPUs: GPU checks of the plans, then simple_gla B=4 and 16K, gdn forward scaling
            # (run at 2b13300 with the last rank's zero-start walk, since taken out)
    step spfinal_checks 130 env FORGE_MG_CHECKS=plans,plans_delta,op_hgrn \
      python3 -m pytest -q -s -m multigpu tests/sp/test_forge_multigpu.py
    ws weak_scaling_fwd_b4 100 2 simple_gla fwd 4 32768 b4h32-32k-incoming
    ws weak_scaling_fwd_gdn 80 2 gated_delta_rule fwd 1 32768 b1h32-32k-fwd-gdn-final
    ws weak_scaling_fwd_16k 60 2 simple_gla fwd 1 16384 b1h32-16k-final ;;
  long)  # the longest sequence one GDN layer trains on 2 GPUs
    step long_sequence 200 torchrun --nproc_per_node 2 scaling_benchmarks/long_sequence.py \
      --out "$OUT" --lengths 256K 512K 1M 2M 4M --set timeout_s=60 ;;
  fusedscan)  # the multi-node issue: scan's rounds for identity, scalar and diagonal
    # transitions in one launch (forge.run_scan_rounds): GPU checks on every card, then
    # the 16K forward at 2 and 4 ranks beside the chain, and forward + backward at 4
    reap
    n=$(nvidia-smi -L | wc -l)
    # (FUSED_CHECKS: the checks to run, default all of scan's; FUSED_WS2=0 / FUSED_WS4=0 /
    # FUSED_BWD=0: without the 2-rank cell / the 4-rank cells / the 4-rank forward + backward)
    checks=available,plans,no_host_sync_scan
    for k in identity scalar diagonal dense; do checks+=,scan_chains_$k; done
    for o in linear_attn simple_gla gla hgrn; do checks+=,scan_op_$o; done
    step fusedscan_checks "${CHECKS_LIMIT:-240}" env FORGE_MG_WORLD=$n \
      FORGE_MG_CHECKS=${FUSED_CHECKS:-$checks} \
      python3 -m pytest -v -p no:cacheprovider tests/sp/test_forge_multigpu.py
    reap
    [ "${FUSED_WS2:-1}" = 1 ] && ws fusedscan_16k_ws2 100 2 simple_gla fwd 1 16384 \
      b1h32-16k-fusedscan forge,scan
    if [ "$n" -ge 4 ] && [ "${FUSED_WS4:-1}" = 1 ]; then
      ws fusedscan_16k_ws4 "${WS_LIMIT:-120}" 4 simple_gla fwd 1 16384 b1h32-16k-fusedscan \
        ${FUSED_STRATEGIES:-forge,scan,serial}
      [ "${FUSED_BWD:-1}" = 1 ] && ws fusedscan_bwd_ws4 120 4 simple_gla fwdbwd 1 16384 \
        b1h32-16k-fwdbwd-fusedscan forge,scan
    fi
    reap ;;
  mqarab)  # the layers issue: MQAR learns on the CPU (the PyTorch forms) and did not on the
    # GPU (2026-11-28, mqar4); the CPU config on a GPU with our kernels (card 1) and with
    # the PyTorch forms (card 2), a vocabulary-8192 config with the PyTorch forms (card 3);
    # card 0 meanwhile: sumtiles
    ab() {  # ab CARD NAME KERNELS ARGS...
      local card=$1 name=$2 kern=$3; shift 3
      ( export CUDA_VISIBLE_DEVICES=$card FORGE_DIST_KERNELS=$kern
        step "$name" "${AB_LIMIT:-300}" python3 launch/train.py --sp 1 "$@" \
          --set train.log_every=20 --set train.ckpt_every=0 --out-dir "$OUT/$name" > /dev/null
        cp "$OUT/$name/log.jsonl" "$OUT/$name.jsonl" 2>/dev/null; rm -rf "$OUT/$name" ) &
    }
    ab 1 mqar_cpucfg_kernels auto --config configs/train_mqar_cpu.toml
    ab 2 mqar_cpucfg_torch torch --config configs/train_mqar_cpu.toml
    ab 3 mqar_v8192_torch torch --config configs/train_mqar.toml --set model.vocab_size=8192 \
      --set data.seq_len=256 \
      --set data.num_kv_pairs=16 --set model.hidden_size=128 --set model.num_heads=2 \
      --set data.batch_size=64 --set train.lr=3e-3 --set train.warmup_steps=100 \
      --set train.steps=20000
    ( export CUDA_VISIBLE_DEVICES=0
      step summary_tiles 280 python3 scaling_benchmarks/kernel_profile.py --ops simple_gla \
        --T 32768 --passes fwd --impls forge_dist --sweep summary --sweep-T 32768 --sweep-B 4 \
        --tag summary-tiles --out "$OUT" > /dev/null ) &
    wait ;;
  stages3)  # the scaling issue's B=4 cell after the summary walk's third pipeline stage
    # (kernels/scalar.py FUSED_CONFIG summary_stages): cards 0-1 the cell (forge, serial,
    # lasp2); card 2 the walker's summary tests compiled; card 3 the summary walk at two and
    # three stages in the segments the B=4 plan walks (4) and in the one-GPU decoupled
    # schedule's (B=1, 64K: 8)
    reap
    ( export CUDA_VISIBLE_DEVICES=3
      for cell in "4 32768 4" "1 65536 8"; do set -- $cell
        step "summary_stages_b$1_seg$3" 200 python3 scaling_benchmarks/kernel_profile.py \
          --ops simple_gla --T 32768 --passes fwd --impls forge_dist --sweep summary \
          --sweep-T "$2" --sweep-B "$1" --sweep-segments "$3" \
          --summary-tiles 64x4x2,64x4x3,128x4x3 --tag "summary-stages-b$1-seg$3" --out "$OUT"
      done ) &
    ( export CUDA_VISIBLE_DEVICES=2
      step summary_tests 300 python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_kernels.py -k "summary or segments" ) &
    CUDA_VISIBLE_DEVICES=0,1 ws stages3_b4_ws2 240 2 simple_gla fwd 4 32768 b4h32-32k-stages3 \
      forge,serial,lasp2
    wait
    reap ;;
  abtiles)  # the scaling issue: simple_gla's summary walks on their own tiles (BV=128, three
    # stages; kernels/scalar.py) against the output walk's (FORGE_DIST_SUMMARY_TILES), in one
    # run on cards 0-1: the forward at B=4, 32K and at B=1, 16K (scan beside the chain there);
    # meanwhile cards 2-3 train MQAR at --sp 2, then card 0 at --sp 1 (the layers issue)
    reap
    ( export CUDA_VISIBLE_DEVICES=2,3
      step mqar_sp2 "${MQAR_LIMIT:-450}" torchrun --nproc_per_node 2 --master_port 29612 \
        launch/train.py --config configs/train_mqar.toml --sp 2 --out-dir "$OUT/mqar_sp2" \
        > /dev/null ) &
    for cell in "4 32768 b4h32-32k forge,serial,lasp2" "1 16384 b1h32-16k forge,scan,serial,lasp2"; do
      read -r b tokens tag strategies <<< "$cell"
      for tiles in "" "BV=64,num_stages=2"; do
        name=$([ -n "$tiles" ] && echo walk-tiles || echo summary-tiles)
        FORGE_DIST_SUMMARY_TILES=$tiles ws "ab_${tag}_$name" 150 2 simple_gla fwd "$b" "$tokens" \
          "$tag-$name" "$strategies"
      done
    done
    CUDA_VISIBLE_DEVICES=0 step mqar_sp1 "${MQAR_LIMIT:-450}" python3 launch/train.py \
      --config configs/train_mqar.toml --sp 1 --out-dir "$OUT/mqar_sp1" > /dev/null
    wait
    mqar_curves
    reap ;;
  final10)  # after the summaries' own tiles (8f7def2): their tests compiled on card 3, then
    # the 2-rank plans check on cards 2-3; meanwhile MQAR (MQAR_STEPS, default the config's)
    # at --sp 2 on cards 0-1 and --sp 1 on card 2
    reap
    steps=${MQAR_STEPS:+--set train.steps=$MQAR_STEPS}
    ( export CUDA_VISIBLE_DEVICES=0,1
      step mqar_sp2 "${MQAR_LIMIT:-480}" torchrun --nproc_per_node 2 --master_port 29612 \
        launch/train.py --config configs/train_mqar.toml --sp 2 $steps --out-dir "$OUT/mqar_sp2" \
        > /dev/null ) &
    ( ( export CUDA_VISIBLE_DEVICES=2
        step mqar_sp1 300 python3 launch/train.py --config configs/train_mqar.toml --sp 1 $steps \
          --out-dir "$OUT/mqar_sp1" > /dev/null ) &
      ( export CUDA_VISIBLE_DEVICES=3
        step summary_tiles_tests 300 python3 -m pytest -q -rs -p no:cacheprovider \
          tests/kernels/test_walker_launches.py tests/kernels/test_kernels.py -k "summary or segments" ) &
      wait
      export CUDA_VISIBLE_DEVICES=2,3
      step plans_check 200 env FORGE_MG_CHECKS=available,plans python3 -m pytest -v \
        -p no:cacheprovider tests/sp/test_forge_multigpu.py ) &
    wait
    mqar_curves
    reap ;;
  sumtiles)  # the scaling issue's B=4 cell: rank 0's summary walk streams k and v before its
    # output walk; how fast can it (docs/design.md section 3)
    step summary_tiles 300 env CUDA_VISIBLE_DEVICES=0 python3 scaling_benchmarks/kernel_profile.py \
      --ops simple_gla --T 32768 --passes fwd --impls forge_dist --sweep summary --sweep-T 32768 \
      --sweep-B 4 --tag summary-tiles --out "$OUT" ;;
  mqar4)  # the layers issue's training run: four MQAR configs of width 128 (2 heads) on one
    # card each, stopped at MQAR_LIMIT s; log.jsonl rows carry elapsed_s and acc
    c=0
    for task in "8192 256 16" "8192 512 32" "8192 512 64" "8192 1024 64"; do
      read -r voc len kv <<< "$task"
      name=mqar_v${voc}_t${len}_kv${kv}
      ( export CUDA_VISIBLE_DEVICES=$c; step $name "${MQAR_LIMIT:-540}" python3 launch/train.py \
          --config configs/train_mqar.toml --sp 1 --set model.vocab_size=$voc --set data.seq_len=$len \
          --set data.num_kv_pairs=$kv --set model.hidden_size=128 --set model.num_heads=2 \
          --set data.batch_size=64 --set train.lr=3e-3 --set train.warmup_steps=100 \
          --set train.steps=${MQAR_STEPS:-20000} --set train.log_every=50 --set train.ckpt_every=0 \
          --out-dir "$OUT/$name" > /dev/null
        cp "$OUT/$name/log.jsonl" "$OUT/$name.jsonl" 2>/dev/null; rm -rf "$OUT/$name" ) &
      c=$((c + 1))
    done
    wait ;;
  train)
    step train_sp1 170 env CUDA_VISIBLE_DEVICES=0 python3 launch/train.py \
      --config configs/train_mqar.toml --sp 1 --set train.steps=${TRAIN_STEPS:-150} --out-dir "$OUT/mqar_sp1"
    step train_sp2 190 torchrun --nproc_per_node 2 launch/train.py \
      --config configs/train_mqar.toml --sp 2 --set train.steps=${TRAIN_STEPS:-150} --out-dir "$OUT/mqar_sp2"
    step train_plot 60 python3 launch/train.py --plot "$OUT/mqar_sp1/log.jsonl" \
      "$OUT/mqar_sp2/log.jsonl" --plot-out "$OUT/mqar_sp1_vs_sp2.png"
    # Only two folder levels come back from the device: keep the logs, drop checkpoints.
    cp "$OUT/mqar_sp1/log.jsonl" "$OUT/mqar_sp1.jsonl" 2>/dev/null
    cp "$OUT/mqar_sp2/log.jsonl" "$OUT/mqar_sp2.jsonl" 2>/dev/null
    rm -rf "$OUT/mqar_sp1" "$OUT/mqar_sp2" ;;
esac
done
# At most 8 files come back from the device: pack the step logs into one archive.
( cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf "logs_$(date +%H%M%S).tgz" ./*.log && rm -f ./*.log )

#!/usr/bin/env bash
# GPU session steps, each bounded, logs under $OUT (or ./out). Usage on the H200 machine:
#   PYTHONPATH=$PWD bash benchmarks/gpu_session.sh PHASE [PHASE ...]
# Phases: tests (every test file in its own process, in parallel, on GPU $TEST_GPU; TEST_SKIP=fuzz leaves one out),
#         test-sets (TEST_SETS="tests/x.py:k expression|...": one process per set, in parallel),
#         memcheck, memcheck-ws (the Gluon kernels: benchmarks/tools/memcheck_ws.py), leak,
#         bench-SUITE (decode, prefill, backward, lowp; on GPU $BENCH_GPU), sweep-FAMILY (python -m tileflash sweep
#         FAMILY on GPU $BENCH_GPU), cp (torchrun over 2 GPUs), demo.
# On a 2-GPU machine run `tests` and the benchmarks at the same time: TEST_GPU=0 BENCH_GPU=1.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=0
TEST_GPU=${TEST_GPU:-0}; BENCH_GPU=${BENCH_GPU:-0}
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@"; echo "== rc=$? $(date +%T)"; }

run_tests() {  # one process per file: compiling dominates, and it is CPU-bound
  local pids=() f
  for f in tests/*/test_*.py; do
    [[ -n ${TEST_SKIP:-} && $f == *$TEST_SKIP* ]] && continue  # e.g. TEST_SKIP=fuzz
    local gpus=$TEST_GPU; [[ $f == *distributed* ]] && gpus=${ALL_GPUS:-$TEST_GPU}  # NCCL: one GPU per rank
    CUDA_VISIBLE_DEVICES=$gpus timeout "${TEST_LIMIT:-330}" python3 -m pytest "$f" -q -p no:cacheprovider \
      > "$OUT/pytest_$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for f in "$OUT"/pytest_*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
  cat "$OUT"/pytest_*.log > "$OUT/pytest.log"; rm -f "$OUT"/pytest_*.log
}

run_test_sets() {  # TEST_SETS="tests/a.py:k expr|tests/b.py:..." -> one pytest process per set, in parallel
  local pids=() i=0 set
  IFS='|' read -ra sets <<< "$TEST_SETS"
  for set in "${sets[@]}"; do
    i=$((i + 1))
    CUDA_VISIBLE_DEVICES=$TEST_GPU timeout "${TEST_LIMIT:-330}" python3 -m pytest "${set%%:*}" -k "${set#*:}" -q \
      -p no:cacheprovider > "$OUT/pytest_set$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for f in "$OUT"/pytest_set*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
  cat "$OUT"/pytest_set*.log > "$OUT/pytest.log"; rm -f "$OUT"/pytest_set*.log
}

for phase in "$@"; do
  case $phase in
    tests) run_tests ;;
    test-sets) run_test_sets ;;
    memcheck)  # one sanitizer process per file (test_backward.py: three, as one took over 300 s in run 178), in
      # parallel; graph capture needs the caching allocator, which memcheck needs off: graph tests are excluded
      pids=() i=0
      for set in tests/ops/test_kvcache.py tests/ops/test_kvcache_quant.py tests/ops/test_merge.py tests/lowp/test_quant.py \
                 tests/ops/test_varlen.py \
                 tests/lowp/test_gemm.py tests/ops/test_fp8_prefill.py \
                 "tests/ops/test_backward.py:func_backward and fp16" \
                 "tests/ops/test_backward.py:func_backward and bf16" "tests/ops/test_backward.py:not func_backward"; do
        f=${set%%:*} k=; [[ $set == *:* ]] && k="${set#*:} and "
        i=$((i + 1))
        CUDA_VISIBLE_DEVICES=$TEST_GPU PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_LIMIT:-330}" \
          compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest "$f" -q -p no:cacheprovider \
          -k "${k}not graph and not overlap and not needle" > "$OUT/memcheck_test_${i}_$(basename "$f" .py).log" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      for f in "$OUT"/memcheck_test_*.log; do
        echo "$(basename "$f"): $(grep -E "ERROR SUMMARY" "$f" | tail -1) $(grep -E "passed|failed" "$f" | tail -1)"
      done ;;
    memcheck-ws)
      CUDA_VISIBLE_DEVICES=$TEST_GPU PYTORCH_NO_CUDA_MEMORY_CACHING=1 step 300 compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 benchmarks/tools/memcheck_ws.py > "$OUT/memcheck_ws.log" 2>&1
      grep -cE "finite|written" "$OUT/memcheck_ws.log"; grep -E "ERROR SUMMARY|NONFINITE|UNWRITTEN" "$OUT/memcheck_ws.log" ;;
    leak) CUDA_VISIBLE_DEVICES=$TEST_GPU step 120 python3 benchmarks/tools/leak_check.py > "$OUT/leak.log" 2>&1
      tail -n 2 "$OUT/leak.log" ;;
    bench-*) suite=${phase#bench-}
      CUDA_VISIBLE_DEVICES=$BENCH_GPU step "${BENCH_LIMIT:-300}" python3 -m tileflash bench "$suite" \
        --json "$OUT/$suite.json" ${BENCH_ARGS:-} > "$OUT/bench_$suite.log" 2>&1
      tail -n 40 "$OUT/bench_$suite.log" ;;
    cp) step 200 torchrun --nproc-per-node 2 -m tileflash bench cp > "$OUT/cp.log" 2>&1; tail -n 30 "$OUT/cp.log" ;;
    sweep-*) family=${phase#sweep-}  # `python -m tileflash sweep FAMILY $SWEEP_ARGS` on GPU $BENCH_GPU
      CUDA_VISIBLE_DEVICES=$BENCH_GPU step "${BENCH_LIMIT:-300}" python3 -m tileflash sweep "$family" ${SWEEP_ARGS:-} \
        --json "$OUT/sweep_$family.json" > "$OUT/sweep_$family.log" 2>&1
      tail -n 40 "$OUT/sweep_$family.log" ;;
    demo) CUDA_VISIBLE_DEVICES=$TEST_GPU step 120 python3 -m examples.serving --preset small > "$OUT/demo.log" 2>&1
      tail -n 8 "$OUT/demo.log" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# This session's device calls (session 20), one per argument: tests | bench. Logs and JSON under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
case "$1" in
  tests)  # every GPU test file in parallel (fuzz apart), then one line per file
    TEST_LIMIT=${TEST_LIMIT:-300} TEST_SKIP=fuzz bash benchmarks/gpu_session.sh tests
    for f in "$OUT"/pytest_*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
    grep -h -B2 -A12 "^FAILED\|Error\b" "$OUT"/pytest_*.log | head -60 ;;
  bench)  # the restructure's before/after rows, the Gluon varlen default, the sweep tool
    python -m tileflash bench host --json "$OUT/host.json" 2>&1 | tail -n 22
    python -m tileflash bench decode --quick --only gqa --json "$OUT/decode.json" 2>&1 | tail -n 14
    python -m tileflash bench prefill --quick --json "$OUT/prefill.json" 2>&1 | tail -n 24
    python -m tileflash sweep backward-ws --shapes 64,0,4096 64,1,4096 64,0,16384 128,0,4096 128,1,16384 \
      --vary keys_major=0,1 dq_by_rows=0,1 --json "$OUT/sweep_bwd_ws.json" 2>/dev/null | tail -n 30
    python -m tileflash sweep decode-quant --vary block_n=16,32 num_warps=4 programs_per_sm=2 --json "$OUT/sweep_quant.json" 2>/dev/null | tail -n 16 ;;
  verify)  # after the Gluon clean-ups: their GPU tests in parallel, then the backward bench
    pids=()
    for f in tests/kernels/test_gluon_backward.py tests/kernels/test_gluon_backward_variants.py \
             tests/kernels/test_gluon_decode_mma.py tests/kernels/test_gluon_forward.py tests/plan tests/lowp/test_gemm.py; do
      timeout 280 python -m pytest "$f" -q -p no:cacheprovider > "$OUT/v_$(basename "$f" .py).log" 2>&1 & pids+=($!)
    done
    timeout 280 python -m pytest tests/ops/test_kvcache.py -q -p no:cacheprovider -k "nvfp4 or fp8" \
      > "$OUT/v_kvcache.log" 2>&1 & pids+=($!)
    wait "${pids[@]}"
    for f in "$OUT"/v_*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
    grep -h "^FAILED\|^E  " "$OUT"/v_*.log | head -20
    python -m tileflash bench backward --quick --json "$OUT/backward.json" 2>&1 | tail -n 16 ;;
esac

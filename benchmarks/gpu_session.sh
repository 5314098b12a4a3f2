#!/usr/bin/env bash
# One GPU session's worth of checks and measurements, in priority order, each bounded, logs under $OUT (or ./out).
# Usage on the H200: PYTHONPATH=$PWD bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
step() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@"; echo "== rc=$?"; }
# 1. The whole test suite natively on the GPU (larger shape grid than the CPU run).
step 300 python3 -m pytest tests -q -x -p no:cacheprovider --ignore=tests/test_fuzz.py > "$OUT/pytest.log" 2>&1
tail -n 3 "$OUT/pytest.log"
# 2. Memory errors: decode, merge, backward, quant tests under memcheck (graph capture needs the caching allocator,
#    which memcheck needs off, so the graph test is excluded).
PYTORCH_NO_CUDA_MEMORY_CACHING=1 step 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest tests/test_decode.py tests/test_merge.py tests/test_backward.py tests/test_quant.py -q \
  -p no:cacheprovider -k "not graph and not overlap" > "$OUT/memcheck.log" 2>&1
grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
step 120 python3 benchmarks/leak_check.py > "$OUT/leak.log" 2>&1; tail -n 1 "$OUT/leak.log"
# 3. Benchmarks, each suite to its own JSON; tables at the end of each log.
for suite in decode prefill backward lowp; do
  step 300 python3 -m tileflash bench "$suite" --json "$OUT/$suite.json" > "$OUT/bench_$suite.log" 2>&1
done
step 120 python3 -m tileflash demo --preset small > "$OUT/demo.log" 2>&1; tail -n 8 "$OUT/demo.log"

#!/usr/bin/env bash
# One GPU session on the H200 (device tool), writing logs to $OUT. From the repository root:
#   bash scripts/gpu_run.sh [steps]      steps: comma list of tests,demo,bench,decode
# (config sweeps: scripts/gpu_sweep_run.sh, which runs them in one process)
# Env: PYTEST_K (test selection), PYTEST_PATHS, TEST_TIMEOUT, TEST_WORKERS, BENCH_SHAPES.
# Every step has a timeout so one hang cannot eat the session.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source .kit/setup.sh > "$OUT/setup.log" 2>&1; cat "$OUT/setup.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
STEPS=${1:-tests,demo,bench}
if [[ $STEPS == *tests* ]]; then
  MAMBA2_TEST_LOG="$OUT/checks.log" timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/} \
    -n ${TEST_WORKERS:-10} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-240} \
    --junitxml="$OUT/gpu_tests.xml" --durations=40 ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 25
fi
if [[ $STEPS == *demo* ]]; then
  timeout 120 python3 -m mamba2_cutile > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; cat "$OUT/demo.log"
fi
if [[ $STEPS == *bench* ]]; then
  DISABLE_AUTOTUNE=1 timeout 300 python3 -m mamba2_cutile bench --shapes ${BENCH_SHAPES:-default} \
    --out "$OUT/bench" --no-progress > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; cat "$OUT/bench.log"
fi
if [[ $STEPS == *decode* ]]; then
  timeout 200 python3 -m mamba2_cutile bench --mode decode --out "$OUT/bench" > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; cat "$OUT/decode.log"
fi
du -sh "${CUDA_TILE_CACHE_DIR:-.kit/cache}" 2>/dev/null

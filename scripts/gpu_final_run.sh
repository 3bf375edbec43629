#!/usr/bin/env bash
# One GPU call for the record: the default forward bench set (JSON, CSV, PNG), then
# `mamba2-cutile verify`, optionally `mamba2-cutile tune` on TUNE_SHAPES (cache under the packed
# output, for tuned_h200.json), a decode sweep on DECODE_BATCHES, and the GPU tests of
# PYTEST_PATHS. $OUT/final.tgz is re-packed after every step, so a call cut short still
# brings back what finished.
set -uo pipefail
OUT=${OUT:-gpu_out}; L=/tmp/final; mkdir -p "$OUT" $L/tuning
pack() { tar czf "$OUT/final.tgz" -C /tmp final; }
source .kit/setup.sh > $L/setup.log 2>&1; tail -n 3 $L/setup.log
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
DISABLE_AUTOTUNE=1 timeout ${FWD_TIMEOUT:-150} python3 -m mamba2_cutile bench --shapes default \
  --out $L/fwd --no-progress > $L/bench-fwd.log 2>&1; echo "fwd rc=$?"; tail -n 30 $L/bench-fwd.log | cut -c1-250
pack
timeout ${VERIFY_TIMEOUT:-130} python3 -m mamba2_cutile verify --json $L/verify.json > $L/verify.log 2>&1
echo "verify rc=$?"; tail -n 8 $L/verify.log | cut -c1-200; pack
if [[ -n ${TUNE_SHAPES:-} ]]; then
  MAMBA2_CUTILE_CACHE_DIR=$L/tuning timeout ${TUNE_TIMEOUT:-120} python3 -m mamba2_cutile tune \
    --shapes $TUNE_SHAPES > $L/tune.log 2>&1; echo "tune rc=$?"; tail -n 20 $L/tune.log | cut -c1-200
  pack
fi
if [[ -n ${DECODE_BATCHES:-} ]]; then
  timeout ${DECODE_TIMEOUT:-60} python3 scripts/sweep_decode.py $DECODE_BATCHES > $L/sweep_decode.jsonl 2> $L/sweep_decode.err
  echo "decode sweep rc=$?"; cut -c1-200 $L/sweep_decode.jsonl; tail -2 $L/sweep_decode.err; pack
fi
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$L/checks.log" timeout ${TEST_TIMEOUT:-180} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-12} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-170} \
    --junitxml="$L/gpu_tests.xml" --durations=25 ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 30
  echo "PASSED: $(grep -c ' PASSED' $L/gpu_tests.log)"
  pack
fi

#!/usr/bin/env bash
# The closing GPU call of a session, most important first, $OUT/closing.tgz re-packed after each
# step: the GPU tests of PYTEST_PATHS beside `mamba2-cutile verify` (neither is timed), the
# training bench at the seed problem (ours, mamba_ssm, TileGym untuned), the decode bench,
# `mamba2-cutile tune` on TUNE_SHAPES (winners cached under the output, for tuned_h200.json),
# and a per-kernel forward sweep on DIAG_SHAPES. Env: PYTEST_PATHS, TEST_WORKERS, *_TIMEOUT.
set -uo pipefail
source scripts/gpu_lib.sh; gpu_setup closing; mkdir -p $L/tuning
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$L/checks.log" timeout ${TEST_TIMEOUT:-170} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-12} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=160 \
    --junitxml="$L/gpu_tests.xml" --durations=10 ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1 &
  TESTS=$!
fi
timeout ${VERIFY_TIMEOUT:-120} python3 -m mamba2_cutile verify --json $L/verify.json > $L/verify.log 2>&1
echo "verify rc=$?"; tail -n 3 $L/verify.log | cut -c1-200; pack
if [[ -n ${TESTS:-} ]]; then
  wait $TESTS; echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 12
  echo "PASSED: $(grep -c ' PASSED' $L/gpu_tests.log)"; pack
fi
DISABLE_AUTOTUNE=1 timeout ${TRAIN_TIMEOUT:-120} python3 -m mamba2_cutile bench --mode train --shapes seed \
  --impls mamba2-cutile,mamba_ssm,tilegym --out $L/train --no-progress > $L/train.log 2>&1
echo "train rc=$?"; grep -E "│ seed" $L/train.log | cut -c1-140; pack
timeout ${DECODE_TIMEOUT:-75} python3 -m mamba2_cutile bench --mode decode --out $L/decode > $L/decode.log 2>&1
echo "decode rc=$?"; cat $L/decode.log; pack
if [[ -n ${TUNE_SHAPES:-} ]]; then
  MAMBA2_CUTILE_CACHE_DIR=$L/tuning timeout ${TUNE_TIMEOUT:-120} python3 -m mamba2_cutile tune \
    --shapes $TUNE_SHAPES > $L/tune.log 2>&1; echo "tune rc=$?"; grep -vE "^\s*$" $L/tune.log | tail -n 12 | cut -c1-200
  ls -la $L/tuning; pack
fi
if [[ -n ${DIAG_SHAPES:-} ]]; then
  MAMBA2_CUTILE_TUNING=0 timeout ${DIAG_TIMEOUT:-45} python3 scripts/sweep.py $DIAG_SHAPES default \
    > $L/diag.jsonl 2> $L/diag.err; echo "diag rc=$?"; cut -c1-300 $L/diag.jsonl; pack
fi
pack

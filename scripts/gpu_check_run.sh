#!/usr/bin/env bash
# One GPU call that checks the defaults: backward config sweep at the seed problem,
# forward+backward bench at the seed problem (ours, mamba_ssm, TileGym untuned), the decode
# bench, then the GPU tests of PYTEST_PATHS; logs packed into $OUT/check.tgz.
# Env: BWD_SWEEP_CONFIGS, PYTEST_PATHS, TEST_TIMEOUT, SKIP (comma list: sweep,fwdbwd,decode).
set -uo pipefail
OUT=${OUT:-gpu_out}; L=/tmp/check; mkdir -p "$OUT" $L
source .kit/setup.sh > $L/setup.log 2>&1; tail -n 3 $L/setup.log
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
SKIP=${SKIP:-}
if [[ $SKIP != *sweep* ]]; then
  timeout ${BWD_SWEEP_TIMEOUT:-100} python3 scripts/sweep_backward.py seed ${BWD_SWEEP_CONFIGS:-default} \
    > $L/sweep_bwd.jsonl 2> $L/sweep_bwd.err; echo "bwd sweep rc=$?"; cut -c1-400 $L/sweep_bwd.jsonl; tail -2 $L/sweep_bwd.err
fi
if [[ $SKIP != *fwdbwd* ]]; then
  DISABLE_AUTOTUNE=1 timeout ${FWDBWD_TIMEOUT:-170} python3 -m mamba2_cutile bench --mode fwdbwd --shapes seed \
    --impls mamba2-cutile,mamba_ssm,tilegym --out $L/fwdbwd --jsonl --no-progress > $L/bench-fwdbwd.log 2>&1
  echo "fwdbwd rc=$?"; grep -E '^\{' $L/bench-fwdbwd.log | cut -c1-900; tail -n 12 $L/bench-fwdbwd.log | cut -c1-250
fi
if [[ $SKIP != *decode* ]]; then
  timeout ${DECODE_TIMEOUT:-90} python3 -m mamba2_cutile bench --mode decode --out $L/decode > $L/decode.log 2>&1
  echo "decode rc=$?"; cat $L/decode.log
fi
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$L/checks.log" timeout ${TEST_TIMEOUT:-180} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-14} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-170} \
    --junitxml="$L/gpu_tests.xml" --durations=25 ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 30
  grep -cE "PASSED" "$L/gpu_tests.log"
fi
tar czf "$OUT/check.tgz" -C /tmp check

#!/usr/bin/env bash
# One GPU call for tuning experiments: forward sweep, decode sweep, then the
# GPU tests of PYTEST_PATHS. Logs to $OUT. Env: SWEEP_SHAPES, SWEEP_CONFIGS (space separated).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source .kit/setup.sh > "$OUT/setup.log" 2>&1; cat "$OUT/setup.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
CONFIGS=${SWEEP_CONFIGS:-default scan_block_n=32,state_fresh_acc=1 scan_block_n=64,state_occupancy=2 scan_block_n=32,scan_lowp=1,state_block_p=32 scan_block_n=32,scan_occupancy=2,state_block_p=32,state_occupancy=2 scan_persistent=1,scan_head_major=1,scan_block_n=32,state_scale_x=1 scan_head_major=1,scan_block_n=32,state_fresh_acc=1,state_scale_x=1 scan_lowp=1,state_load_latency=4 scan_block_n=16,state_block_p=32,state_fresh_acc=1}
MAMBA2_CUTILE_TUNING=0 timeout ${SWEEP_TIMEOUT:-180} python3 scripts/sweep.py ${SWEEP_SHAPES:-seed,mamba2-2.7b-T8K} $CONFIGS \
  > "$OUT/sweep.jsonl" 2> "$OUT/sweep.err"; echo "sweep rc=$?"; cat "$OUT/sweep.jsonl"; tail -3 "$OUT/sweep.err"
if [[ -n ${DECODE_SWEEP:-1} ]]; then
  timeout 80 python3 scripts/sweep_decode.py > "$OUT/sweep_decode.jsonl" 2> "$OUT/sweep_decode.err"
  echo "decode sweep rc=$?"; cat "$OUT/sweep_decode.jsonl"; tail -3 "$OUT/sweep_decode.err"
fi
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$OUT/checks.log" timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-14} --dist loadgroup -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-180} \
    --junitxml="$OUT/gpu_tests.xml" --durations=15 > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 30
fi

#!/usr/bin/env bash
# One GPU call for tuning experiments: forward sweep, backward sweep, decode sweep, then the
# GPU tests of PYTEST_PATHS; everything packed into $OUT/sweep.tgz (the device tool brings back
# few files). Env: SWEEP_SHAPES, SWEEP_CONFIGS ("none" skips), BWD_SWEEP_SHAPES,
# BWD_SWEEP_CONFIGS (unset skips), ABLATE (a backward
# config for scripts/ablate_backward.py; unset skips), DECODE_BATCHES ("none" skips), PYTEST_PATHS, PYTEST_K.
set -uo pipefail
source scripts/gpu_lib.sh; gpu_setup sweep
CONFIGS=${SWEEP_CONFIGS:-default}
if [[ $CONFIGS != none ]]; then
  MAMBA2_CUTILE_TUNING=0 timeout ${SWEEP_TIMEOUT:-180} python3 scripts/sweep.py ${SWEEP_SHAPES:-seed,mamba2-2.7b-T8K} $CONFIGS \
    > $L/sweep.jsonl 2> $L/sweep.err; echo "sweep rc=$?"; cut -c1-400 $L/sweep.jsonl; tail -3 $L/sweep.err
fi
if [[ -n ${BWD_SWEEP_CONFIGS:-} ]]; then
  timeout ${BWD_SWEEP_TIMEOUT:-150} python3 scripts/sweep_backward.py ${BWD_SWEEP_SHAPES:-seed} $BWD_SWEEP_CONFIGS \
    > $L/sweep_bwd.jsonl 2> $L/sweep_bwd.err; echo "bwd sweep rc=$?"; cut -c1-500 $L/sweep_bwd.jsonl; tail -3 $L/sweep_bwd.err
fi
if [[ -n ${ABLATE:-} ]]; then
  timeout ${ABLATE_TIMEOUT:-120} python3 scripts/ablate_backward.py $ABLATE > $L/ablate.jsonl 2> $L/ablate.err
  echo "ablate rc=$?"; cat $L/ablate.jsonl; tail -3 $L/ablate.err
fi
if [[ ${DECODE_BATCHES:-1,8,64,256} != none ]]; then
  timeout ${DECODE_TIMEOUT:-100} python3 scripts/sweep_decode.py ${DECODE_BATCHES:-1,8,64,256} > $L/sweep_decode.jsonl 2> $L/sweep_decode.err
  echo "decode sweep rc=$?"; cut -c1-200 $L/sweep_decode.jsonl; tail -3 $L/sweep_decode.err
fi
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$L/checks.log" timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-14} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-180} \
    --junitxml="$L/gpu_tests.xml" --durations=25 ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 30
fi
pack

#!/usr/bin/env bash
# Tune, then measure with the winners: `mamba2-cutile tune` on TUNE_SHAPES (cache under the
# packed output, for tuned_h200.json), the forward bench on the same shapes with that cache
# (ours and mamba_ssm), the training bench at the seed problem (ours) with it, the GPU tests
# of PYTEST_PATHS/PYTEST_K, and a per-kernel forward breakdown on DIAG_SHAPES (with their
# options). $OUT/tuned.tgz is re-packed after every step.
set -uo pipefail
source scripts/gpu_lib.sh; gpu_setup tuned; mkdir -p $L/tuning
export MAMBA2_CUTILE_CACHE_DIR=$L/tuning
timeout ${TUNE_TIMEOUT:-90} python3 -m mamba2_cutile tune --shapes $TUNE_SHAPES > $L/tune.log 2>&1
echo "tune rc=$?"; grep -E "^\S.*ms|forward|rejected|Error" $L/tune.log | cut -c1-160; pack
DISABLE_AUTOTUNE=1 timeout ${FWD_TIMEOUT:-100} python3 -m mamba2_cutile bench --shapes $TUNE_SHAPES \
  --impls mamba2-cutile,mamba_ssm --out $L/fwd --jsonl --no-progress > $L/fwd.log 2>&1
echo "fwd rc=$?"; grep -E "│ " $L/fwd.log | cut -c1-150; pack
timeout ${TRAIN_TIMEOUT:-40} python3 -m mamba2_cutile bench --mode fwdbwd --shapes seed \
  --impls mamba2-cutile --out $L/train --no-progress > $L/train.log 2>&1
echo "train rc=$?"; grep -E "│ seed" $L/train.log | cut -c1-150; pack
if [[ -n ${PYTEST_PATHS:-} ]]; then
  timeout ${TEST_TIMEOUT:-60} python3 -m pytest -m gpu $PYTEST_PATHS -n ${TEST_WORKERS:-4} -v \
    -p no:cacheprovider -p no:benchmark ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 8; pack
fi
if [[ -n ${DIAG_SHAPES:-} ]]; then
  timeout ${DIAG_TIMEOUT:-45} python3 -c "
import json, sys
from mamba2_cutile.bench import problems, runner
for s in problems.select('$DIAG_SHAPES'):
    print(json.dumps(runner.breakdown(s)), flush=True)
" > $L/diag.jsonl 2> $L/diag.err; echo "diag rc=$?"; cut -c1-400 $L/diag.jsonl; tail -2 $L/diag.err; pack
fi

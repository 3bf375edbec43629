#!/usr/bin/env bash
# One GPU call for the record: `mamba2-cutile tune` on TUNE_SHAPES (winners cached under the
# packed output, for tuned_h200.json), then with that cache the default forward bench set
# (JSON, CSV, PNG: ours, mamba_ssm, TileGym untuned) and `mamba2-cutile verify`, then
# TileGym's tuned form at the seed problem (its own autotune, about 200 s), the options set
# (ours and mamba_ssm) and the decode bench when asked. $OUT/record.tgz is re-packed after
# every step, so a call cut short still brings back what finished.
# Env: TUNE_SHAPES (empty: no tuning), SKIP_FWD=1, SKIP_VERIFY=1, TILEGYM_TUNED=1, OPTIONS=1,
# DECODE_BENCH=1, *_TIMEOUT.
set -uo pipefail
source scripts/gpu_lib.sh; gpu_setup record; mkdir -p $L/tuning
export MAMBA2_CUTILE_CACHE_DIR=$L/tuning
if [[ -n ${TUNE_SHAPES:-} ]]; then
  timeout ${TUNE_TIMEOUT:-150} python3 -m mamba2_cutile tune --shapes $TUNE_SHAPES \
    > $L/tune.log 2>&1; echo "tune rc=$?"; tail -n 20 $L/tune.log | cut -c1-220; pack
fi
if [[ -z ${SKIP_FWD:-} ]]; then
  DISABLE_AUTOTUNE=1 timeout ${FWD_TIMEOUT:-140} python3 -m mamba2_cutile bench --shapes default \
    --out $L/fwd --no-progress > $L/bench-fwd.log 2>&1; echo "fwd rc=$?"; tail -n 22 $L/bench-fwd.log | cut -c1-250
  pack
fi
if [[ -z ${SKIP_VERIFY:-} ]]; then
  timeout ${VERIFY_TIMEOUT:-80} python3 -m mamba2_cutile verify --json $L/verify.json > $L/verify.log 2>&1
  echo "verify rc=$?"; tail -n 4 $L/verify.log | cut -c1-200; pack
fi
if [[ -n ${DECODE_BENCH:-} ]]; then
  timeout ${DECODE_TIMEOUT:-70} python3 -m mamba2_cutile bench --mode decode --out $L/decode > $L/decode.log 2>&1
  echo "decode rc=$?"; cat $L/decode.log; pack
fi
if [[ -n ${OPTIONS:-} ]]; then
  DISABLE_AUTOTUNE=1 timeout ${OPTIONS_TIMEOUT:-120} python3 -m mamba2_cutile bench --shapes ${OPTIONS_SHAPES:-options} \
    --impls mamba2-cutile,mamba_ssm --out $L/options --no-progress > $L/options.log 2>&1
  echo "options rc=$?"; tail -n 16 $L/options.log | cut -c1-250; pack
fi
if [[ -n ${TILEGYM_TUNED:-} ]]; then
  timeout ${TILEGYM_TIMEOUT:-250} python3 -m mamba2_cutile bench --shapes seed \
    --impls mamba2-cutile,mamba_ssm,tilegym --out $L/tilegym-tuned --no-progress > $L/tilegym-tuned.log 2>&1
  echo "tilegym tuned rc=$?"; tail -n 10 $L/tilegym-tuned.log | cut -c1-250; pack
fi
pack

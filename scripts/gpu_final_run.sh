#!/usr/bin/env bash
# One GPU call for the record: the default forward bench set (JSON, CSV, PNG), then
# `mamba2-cutile verify`, then `mamba2-cutile tune` on TUNE_SHAPES with its cache under the
# packed output (the winners, for tuned_h200.json), then a decode sweep on DECODE_BATCHES;
# logs packed into $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-gpu_out}; L=/tmp/final; mkdir -p "$OUT" $L/tuning
source .kit/setup.sh > $L/setup.log 2>&1; tail -n 3 $L/setup.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
DISABLE_AUTOTUNE=1 timeout ${FWD_TIMEOUT:-150} python3 -m mamba2_cutile bench --shapes default \
  --out $L/fwd --no-progress > $L/bench-fwd.log 2>&1; echo "fwd rc=$?"; tail -n 30 $L/bench-fwd.log | cut -c1-250
timeout ${VERIFY_TIMEOUT:-130} python3 -m mamba2_cutile verify --json $L/verify.json > $L/verify.log 2>&1
echo "verify rc=$?"; tail -n 8 $L/verify.log | cut -c1-200
if [[ -n ${TUNE_SHAPES:-} ]]; then
  MAMBA2_CUTILE_CACHE_DIR=$L/tuning timeout ${TUNE_TIMEOUT:-120} python3 -m mamba2_cutile tune \
    --shapes $TUNE_SHAPES > $L/tune.log 2>&1; echo "tune rc=$?"; tail -n 20 $L/tune.log | cut -c1-200
  ls -la $L/tuning
fi
if [[ -n ${DECODE_BATCHES:-} ]]; then
  timeout ${DECODE_TIMEOUT:-60} python3 scripts/sweep_decode.py $DECODE_BATCHES > $L/sweep_decode.jsonl 2> $L/sweep_decode.err
  echo "decode sweep rc=$?"; cut -c1-200 $L/sweep_decode.jsonl; tail -2 $L/sweep_decode.err
fi
tar czf "$OUT/final.tgz" -C /tmp final

#!/usr/bin/env bash
# One GPU call for tuning: `mamba2-cutile tune` on the given shapes (the winners land in
# $OUT/tuning/tuning.json, to be merged into src/mamba2_cutile/tuned_h200.json), the decode
# sweep (incl. persistent grids), and forward+backward at the seed problem with per-launch
# breakdown, default backward config and lowp; then `mamba2-cutile verify`, and with
# TILEGYM_TUNED=1 the seed problem against TileGym's tuned form (about 200 s of its autotune).
# Env: TUNE_SHAPES (bench registry keys).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/tuning" /tmp/t
source .kit/setup.sh > /tmp/t/setup.log 2>&1; cat /tmp/t/setup.log
MAMBA2_CUTILE_CACHE_DIR="$OUT/tuning" timeout ${TUNE_TIMEOUT:-300} python3 -m mamba2_cutile tune \
  --shapes ${TUNE_SHAPES:-seed,models} > /tmp/t/tune.log 2>&1; echo "tune rc=$?"
timeout ${DECODE_TIMEOUT:-100} python3 scripts/sweep_decode.py 1,8,64,256 > /tmp/t/sweep_decode.jsonl \
  2> /tmp/t/sweep_decode.err; echo "decode sweep rc=$?"
for cfg in default lowp=1; do
  MAMBA2_CUTILE_BWD_CONFIG=$cfg MAMBA2_CUTILE_BACKWARD=cutile DISABLE_AUTOTUNE=1 timeout 150 \
    python3 -m mamba2_cutile bench --mode fwdbwd --shapes seed --impls mamba2-cutile,mamba_ssm \
    --breakdown --jsonl --no-progress > "/tmp/t/fwdbwd-$cfg.log" 2>&1; echo "fwdbwd $cfg rc=$?"
done
timeout ${VERIFY_TIMEOUT:-120} python3 -m mamba2_cutile verify --json /tmp/t/verify.json \
  > /tmp/t/verify.log 2>&1; echo "verify rc=$?"
if [[ -n ${TILEGYM_TUNED:-} ]]; then
  timeout 330 python3 -m mamba2_cutile bench --shapes seed --impls mamba2-cutile,mamba_ssm,tilegym \
    --out /tmp/t/tilegym-tuned --no-progress > /tmp/t/tilegym-tuned.log 2>&1
  echo "tilegym tuned rc=$?"; tail -n 12 /tmp/t/tilegym-tuned.log | cut -c1-220
fi
tail -n 30 /tmp/t/tune.log | cut -c1-200
tail -n 5 /tmp/t/verify.log | cut -c1-200
grep -E '^\{' /tmp/t/fwdbwd-*.log | cut -c1-600
tar czf "$OUT/tune.tgz" -C /tmp t

#!/usr/bin/env bash
# One GPU call that checks the defaults: backward config sweep at the seed problem (optionally
# picking the fastest config for the bench that follows), the training bench at the seed
# problem (ours, mamba_ssm, TileGym untuned), decode sweep / eager-latency breakdown / bench,
# then the GPU tests of PYTEST_PATHS; logs re-packed into $OUT/check.tgz after every step.
# Env: BWD_SWEEP_CONFIGS, BWD_PICK=1 (bench ours with the sweep's fastest config, gradients
# within 2% of the first config's), BENCH_MODE (fwdbwd | train), DECODE_SWEEP_BATCHES,
# DECODE_TIMING_BATCHES (scripts/decode_timing.py), DECODE_LATENCY_BATCHES, PYTEST_PATHS, TEST_TIMEOUT, SKIP (comma list: sweep,fwdbwd,decode).
set -uo pipefail
source scripts/gpu_lib.sh; gpu_setup check
SKIP=${SKIP:-}
if [[ $SKIP != *sweep* ]]; then
  timeout ${BWD_SWEEP_TIMEOUT:-100} python3 scripts/sweep_backward.py seed ${BWD_SWEEP_CONFIGS:-default} \
    > $L/sweep_bwd.jsonl 2> $L/sweep_bwd.err; echo "bwd sweep rc=$?"; cut -c1-400 $L/sweep_bwd.jsonl; tail -2 $L/sweep_bwd.err
  if [[ ${BWD_PICK:-0} == 1 ]]; then
    PICK=$(python3 - $L/sweep_bwd.jsonl <<'EOF'
import json, sys
best = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "whole_ms" not in r or max(r.get("vs_first", {}).values(), default=0) > 0.02:
        continue
    if "state_dtype" in r["config"]:
        continue
    if best is None or r["whole_ms"] < best["whole_ms"]:
        best = r
print("" if best is None or best["config"] == "default" else best["config"])
EOF
)
    export MAMBA2_CUTILE_BWD_CONFIG="$PICK"; echo "picked backward config: '${PICK}'" | tee $L/picked.txt
  fi
  pack
fi
if [[ $SKIP != *fwdbwd* ]]; then
  DISABLE_AUTOTUNE=1 timeout ${FWDBWD_TIMEOUT:-170} python3 -m mamba2_cutile bench --mode ${BENCH_MODE:-fwdbwd} --shapes seed \
    --impls mamba2-cutile,mamba_ssm,tilegym --out $L/fwdbwd --jsonl --no-progress > $L/bench-fwdbwd.log 2>&1
  echo "bench ${BENCH_MODE:-fwdbwd} rc=$?"; grep -E '^\{' $L/bench-fwdbwd.log | cut -c1-700; tail -n 24 $L/bench-fwdbwd.log | cut -c1-250
  pack
fi
unset MAMBA2_CUTILE_BWD_CONFIG
if [[ -n ${DECODE_SWEEP_BATCHES:-} ]]; then
  timeout ${DECODE_SWEEP_TIMEOUT:-80} python3 scripts/sweep_decode.py $DECODE_SWEEP_BATCHES > $L/sweep_decode.jsonl 2> $L/sweep_decode.err
  echo "decode sweep rc=$?"; cut -c1-200 $L/sweep_decode.jsonl; tail -3 $L/sweep_decode.err
  pack
fi
if [[ -n ${DECODE_TIMING_BATCHES:-} ]]; then
  timeout ${DECODE_TIMING_TIMEOUT:-120} python3 scripts/decode_timing.py $DECODE_TIMING_BATCHES > $L/decode_timing.jsonl 2> $L/decode_timing.err
  echo "decode timing rc=$?"; cut -c1-220 $L/decode_timing.jsonl; tail -3 $L/decode_timing.err
  pack
fi
for b in ${DECODE_LATENCY_BATCHES:-}; do
  timeout 60 python3 scripts/decode_latency.py $b >> $L/decode_latency.jsonl 2>> $L/decode_latency.err
  echo "decode latency b=$b rc=$?"
done
[[ -n ${DECODE_LATENCY_BATCHES:-} ]] && { cat $L/decode_latency.jsonl; tail -3 $L/decode_latency.err; pack; }
if [[ $SKIP != *decode* ]]; then
  timeout ${DECODE_TIMEOUT:-90} python3 -m mamba2_cutile bench --mode decode --out $L/decode > $L/decode.log 2>&1
  echo "decode rc=$?"; cat $L/decode.log
  pack
fi
if [[ -n ${PYTEST_PATHS:-} ]]; then
  MAMBA2_TEST_LOG="$L/checks.log" timeout ${TEST_TIMEOUT:-180} python3 -m pytest -m gpu $PYTEST_PATHS \
    -n ${TEST_WORKERS:-14} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-170} \
    --junitxml="$L/gpu_tests.xml" --durations=25 ${PYTEST_K:+-k "$PYTEST_K"} > "$L/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$L/gpu_tests.log" | tail -n 30
  grep -cE "PASSED" "$L/gpu_tests.log"
fi
pack

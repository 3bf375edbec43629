#!/usr/bin/env bash
# One GPU session on the H200 (device tool), writing logs to $OUT. From the repository root:
#   bash scripts/gpu_run.sh [steps]      steps: comma list of tests,demo,sweep,bench,decode
# Env: PYTEST_K (test selection), TEST_TIMEOUT, TEST_WORKERS, SWEEP_CONFIGS, SWEEP_SHAPES,
#      BENCH_SHAPES. Every step has a timeout so one hang cannot eat the session.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source .kit/setup.sh > "$OUT/setup.log" 2>&1; cat "$OUT/setup.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
STEPS=${1:-tests,demo,sweep,bench}
if [[ $STEPS == *tests* ]]; then
  MAMBA2_TEST_LOG="$OUT/checks.log" timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu ${PYTEST_PATHS:-tests/} \
    -n ${TEST_WORKERS:-10} --dist loadgroup -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-240} \
    --junitxml="$OUT/gpu_tests.xml" --durations=40 ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 25
fi
if [[ $STEPS == *demo* ]]; then
  timeout 120 python3 -m mamba2_cutile > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; cat "$OUT/demo.log"
fi
if [[ $STEPS == *sweep* ]]; then
  for shape in ${SWEEP_SHAPES:-seed}; do
    for cfg in ${SWEEP_CONFIGS:-default scan_block_n=32 scan_block_n=64 scan_block_n=32,scan_lowp=1 scan_lowp=1 scan_warps=8 scan_head_major=1 state_scale_x=1 scan_block_q=64,scan_occupancy=2 scan_block_q=64,scan_occupancy=4 scan_lowp=1,scan_occupancy=2}; do
      MAMBA2_CUTILE_TUNING=0 MAMBA2_CUTILE_CONFIG=$cfg timeout 150 python3 -m mamba2_cutile bench \
        --impls mamba2-cutile --shapes $shape --reps 30 --breakdown --jsonl --no-progress 2>&1 \
        | grep -E '^\{' | sed "s/^/$cfg /" >> "$OUT/sweep.log"
    done
  done
  python3 - "$OUT/sweep.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    cfg, js = line.split(" ", 1)
    r = json.loads(js)
    if "kernels" in r:
        print("   ", r["shape"], {k: round(v, 4) for k, v in r["kernels"].items()})
    else:
        print(cfg, r["shape"], r.get("status"), (r.get("graph") or {}).get("median_ms"))
PY
fi
if [[ $STEPS == *bench* ]]; then
  DISABLE_AUTOTUNE=1 timeout 300 python3 -m mamba2_cutile bench --shapes ${BENCH_SHAPES:-default} \
    --out "$OUT/bench" --no-progress > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; cat "$OUT/bench.log"
fi
if [[ $STEPS == *decode* ]]; then
  timeout 200 python3 -m mamba2_cutile bench --mode decode --out "$OUT/bench" > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; cat "$OUT/decode.log"
fi
du -sh "${CUDA_TILE_CACHE_DIR:-.kit/cache}" 2>/dev/null

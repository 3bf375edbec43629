#!/usr/bin/env bash
# One GPU session on the H200 (device tool): tests, demo, config sweep, benchmark -> $OUT.
# Usage (from the repository root, on the GPU machine):  bash scripts/gpu_run.sh [steps]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source .kit/setup.sh > "$OUT/setup.log" 2>&1; cat "$OUT/setup.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
STEPS=${1:-tests,demo,sweep,bench}
if [[ $STEPS == *tests* ]]; then
  MAMBA2_TEST_LOG="$OUT/checks.log" timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu tests/ -n ${TEST_WORKERS:-10} -v -p no:cacheprovider -p no:benchmark --timeout=${TEST_CASE_TIMEOUT:-240} \
    --junitxml="$OUT/gpu_tests.xml" ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?"; tail -n 25 "$OUT/gpu_tests.log"
fi
if [[ $STEPS == *demo* ]]; then
  timeout 120 python3 -m mamba2_cutile > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; cat "$OUT/demo.log"
fi
if [[ $STEPS == *sweep* ]]; then
  for cfg in ${SWEEP_CONFIGS:-state_block_n=16 state_block_n=32 state_block_n=64 scan_block_q=64}; do
    MAMBA2_CUTILE_CONFIG=$cfg timeout 120 python3 -m mamba2_cutile bench --impls mamba2-cutile \
      --shapes seed --reps 30 --breakdown 2>&1 | grep -E '^\{' | sed "s/^/$cfg /" >> "$OUT/sweep.log"
  done
  cat "$OUT/sweep.log" | python3 -c "
import sys, json
for line in sys.stdin:
    cfg, js = line.split(' ', 1); r = json.loads(js)
    if r.get('impl') == 'breakdown': print('   ', {k: round(v, 4) for k, v in r.items() if isinstance(v, float)})
    else: print(cfg, r.get('status'), r.get('graph', {}).get('median_ms'), r.get('first_call_s'))"
fi
if [[ $STEPS == *bench* ]]; then
  DISABLE_AUTOTUNE=1 timeout 300 python3 -m mamba2_cutile bench --shapes ${BENCH_SHAPES:-seed} \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  python3 -c "
import json
d = json.load(open('$OUT/bench.json')); print(d['versions'])
for r in d['rows']:
    g = r.get('graph', {}); e = r.get('eager', {})
    print(f\"{r['shape']:<22} {r['impl']:<14} {r['status'][:40]:<12} graph {g.get('median_ms', float('nan')):.4f} ms  eager {e.get('median_ms', float('nan')):.4f} ms  floor {r['floor_ms']:.4f} ms first {r.get('first_call_s', float('nan')):.1f}s\")
" 2>&1 | tee "$OUT/bench_table.txt"
fi

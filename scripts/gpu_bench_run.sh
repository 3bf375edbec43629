#!/usr/bin/env bash
# One GPU call for the benchmark: the default forward set (JSON, CSV, PNG) and forward+backward
# at the seed problem with the cuTile backward, packed into $OUT/bench.tgz (few files come back).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT" /tmp/b
source .kit/setup.sh > /tmp/b/setup.log 2>&1; cat /tmp/b/setup.log
DISABLE_AUTOTUNE=1 timeout ${FWD_TIMEOUT:-150} python3 -m mamba2_cutile bench --shapes default \
  --out /tmp/b/fwd --no-progress > /tmp/b/bench-fwd.log 2>&1; echo "fwd rc=$?"
MAMBA2_CUTILE_BACKWARD=cutile DISABLE_AUTOTUNE=1 timeout ${BWD_TIMEOUT:-170} python3 -m mamba2_cutile \
  bench --mode fwdbwd --shapes seed --impls mamba_ssm,mamba2-cutile,tilegym --out /tmp/b/fwdbwd \
  --jsonl --no-progress > /tmp/b/bench-fwdbwd.log 2>&1; echo "fwdbwd rc=$?"
grep -E '^\{' /tmp/b/bench-fwdbwd.log | cut -c1-1500; tail -n 5 /tmp/b/bench-fwdbwd.log | cut -c1-400
tar czf "$OUT/bench.tgz" -C /tmp b

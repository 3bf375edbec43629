# Sourced by the one-call GPU scripts: `gpu_setup NAME` makes the log folder L=/tmp/NAME, the
# `pack` function (L packed into $OUT/NAME.tgz: the device tool brings back few files, so each
# step re-packs and a call cut short still returns what finished), brings cuTile in from the
# kit (.kit, carried by the run), the test plug-ins' wheels, and records the GPU.
gpu_setup() {
  OUT=${OUT:-gpu_out}; L=/tmp/$1; mkdir -p "$OUT" "$L"
  eval "pack() { tar czf \"\$OUT/$1.tgz\" -C /tmp $1; }"
  source .kit/setup.sh > "$L/setup.log" 2>&1; tail -n 1 "$L/setup.log"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/extra/*.whl >/dev/null 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$L/gpu.txt" 2>&1
}

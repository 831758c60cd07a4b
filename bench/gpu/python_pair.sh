#!/usr/bin/env bash
# On a GPU machine: builds the `ferry` Python module from source for this machine's Python (its
# interpreter usually differs from the build machine's), taking pybind11 and xxhash from
# .gpu/pydeps when the machine lacks them (bench/gpu/package.sh --python puts them there), then runs
# the GPU example pair, examples/python/gpu_trainer.py and gpu_rollout.py, three times: with the
# buckets in device memory over cuda_ipc, with direct reads (the default), and with the trainer's
# weights in PyTorch's expandable segments (no IPC handle: they travel as bytes). Each run must
# report every step, with the census at 0 and the rollout's tensors at their addresses.
# usage: bench/gpu/python_pair.sh OUT_DIR [STEPS]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/gpu/python_pair.sh OUT_DIR [STEPS]}
steps=${2:-5}
mkdir -p "$out"
deps=$PWD/.gpu/pydeps
args=()
[ -d "$deps/pybind11" ] && args+=("-Dpybind11_DIR=$deps/pybind11/share/cmake/pybind11")
if [ ! -f /usr/include/xxhash.h ] && [ -f "$deps/xxhash/xxhash.h" ]; then
  args+=("-DXXHASH_INCLUDE_DIR=$deps/xxhash" "-DXXHASH_LIBRARY=$deps/xxhash/libxxhash.so")
  export LD_LIBRARY_PATH=$deps/xxhash:${LD_LIBRARY_PATH:-}
fi
python3 -c 'import sys, sysconfig, os; p = sysconfig.get_paths()["include"]; print(sys.version.split()[0], p, os.path.exists(p + "/Python.h"))' \
  > "$out/python.txt" 2>&1
{
  cmake -S . -B build-py-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_CUDA=ON \
    -DPython3_EXECUTABLE="$(command -v python3)" "${args[@]}" &&
    timeout 420 ninja -C build-py-gpu ferry_python
} > "$out/py-build.log" 2>&1 || { echo "python module build failed"; cat "$out/python.txt"; tail -30 "$out/py-build.log"; exit 1; }
export PYTHONPATH=$PWD/build-py-gpu/python:$PWD/examples/python
status=0
# expandable: PyTorch's expandable segments (cuMemMap memory) have no legacy IPC handle, so the
# trainer's weights travel as bytes, with one warning, instead of being read in place.
for mode in ${FERRY_PAIR_MODES:-cuda_ipc direct expandable}; do
  transport=auto
  [ "$mode" = cuda_ipc ] && transport=cuda_ipc
  alloc=${PYTORCH_CUDA_ALLOC_CONF:-}
  [ "$mode" = expandable ] && alloc=expandable_segments:True
  log=$out/trainer-$mode.txt
  FERRY_TRANSPORT=$transport PYTORCH_CUDA_ALLOC_CONF=$alloc timeout 180 python3 examples/python/gpu_trainer.py \
    --steps "$steps" > "$log" 2>&1 &
  trainer=$!
  addr=
  for _ in $(seq 300); do
    addr=$(grep -o 'coordinator at [^ ]*' "$log" | awk '{print $3}')
    [ -n "$addr" ] && break
    sleep 0.2
  done
  if [ -z "$addr" ]; then
    echo "$mode: the trainer printed no coordinator address"; cat "$log"; kill $trainer 2> /dev/null; status=1; continue
  fi
  FERRY_TRANSPORT=$transport timeout 180 python3 examples/python/gpu_rollout.py --coordinator "$addr" \
    > "$out/rollout-$mode.txt" 2>&1
  rollout_rc=$?
  wait $trainer
  trainer_rc=$?
  done_steps=$(grep -c "moved=0/" "$log")
  served=$(grep -c "^serving v" "$out/rollout-$mode.txt")
  warned=$(grep -c "direct reads unavailable" "$log")
  echo "$mode: trainer rc=$trainer_rc rollout rc=$rollout_rc steps with census 0: $done_steps/$steps served: $served" \
    "warnings of weights sent as bytes: $warned"
  [ "$mode" = expandable ] && [ "$warned" -ne 1 ] && status=1
  [ $trainer_rc -eq 0 ] && [ $rollout_rc -eq 0 ] && [ "$done_steps" -eq "$steps" ] && [ "$served" -eq "$steps" ] || status=1
  tail -n 3 "$log" "$out/rollout-$mode.txt"
done
exit $status

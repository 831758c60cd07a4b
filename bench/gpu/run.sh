#!/usr/bin/env bash
# One command on a GPU machine: builds ferry (or unpacks the binaries bench/gpu/package.sh made),
# runs the GPU tests, compute-sanitizer memcheck, and the benchmarks, and writes into OUT_DIR:
#   env.txt        card, driver, CUDA, PyTorch versions, date
#   tests.log      every GPU test's output
#   sanitizer.log  compute-sanitizer memcheck of the CUDA tests
#   results.jsonl  benchmark lines ({"bench":...,"ratio":...})
#   kernels.png    kernel throughput beside the device-copy baseline
# usage: bench/gpu/run.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/gpu/run.sh OUT_DIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast stays off
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1
  uname -r
} > "$out/env.txt" 2>&1

if [ -f .gpu/ferry-gpu.tar.xz ]; then
  root=/tmp/ferry-gpu
  rm -rf "$root" && mkdir -p "$root" && tar -C "$root" -xJf .gpu/ferry-gpu.tar.xz
  bin=$root/bin
  export LD_LIBRARY_PATH=$root/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  echo "binaries: prebuilt (bench/gpu/package.sh)" >> "$out/env.txt"
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_CUDA=ON > "$out/build.log" 2>&1 &&
    cmake --build build-gpu >> "$out/build.log" 2>&1 || { echo "build failed"; tail -50 "$out/build.log"; exit 1; }
  bin=build-gpu/bin
  echo "binaries: built here" >> "$out/env.txt"
fi

run() {  # run NAME CMD...: appends to tests.log, remembers failures
  echo "=== $*" >> "$out/tests.log"
  timeout 300 "$@" >> "$out/tests.log" 2>&1
  local rc=$?
  echo "=== rc=$rc" >> "$out/tests.log"
  [ $rc -eq 0 ] || status=1
}

for t in kernels_quantize_test kernels_gptq_test kernels_gemm_test kernels_bad_input_test core_buffer_test \
         reload_gpu_test reload_stability_test reload_oracle_test reload_instrument_test; do
  [ -x "$bin/$t" ] && run "$bin/$t"
done
[ -x "$bin/transport_conformance_test" ] && run "$bin/transport_conformance_test" --gtest_filter='*cuda_ipc*:*nccl*'
run "$bin/ferry-demo"

# compute-sanitizer on the CUDA paths (the tests compare CUDA against the CPU bit for bit).
if command -v compute-sanitizer > /dev/null; then
  for t in "kernels_quantize_test --gtest_filter=*Cuda*" "kernels_gptq_test --gtest_filter=*Cuda*" \
           "kernels_gemm_test --gtest_filter=*Cuda*" "reload_gpu_test"; do
    set -- $t
    [ -x "$bin/$1" ] || continue
    echo "=== compute-sanitizer memcheck $t" >> "$out/sanitizer.log"
    timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/$@" >> "$out/sanitizer.log" 2>&1
    echo "=== rc=$?" >> "$out/sanitizer.log"
  done
fi

"$bin/ferry" bench kernels --device all --json --rows 8192 --cols 8192 >> "$out/results.jsonl" 2>> "$out/tests.log"
"$bin/ferry" bench reload --json --device all >> "$out/results.jsonl" 2>> "$out/tests.log"
python3 bench/gpu/plot.py "$out/results.jsonl" "$out/kernels.png" >> "$out/tests.log" 2>&1
grep -E "^=== (rc=|.*(PASSED|FAILED))" "$out/tests.log" | tail -40
grep -E "ERROR SUMMARY|=== rc" "$out/sanitizer.log" 2>/dev/null
cat "$out/results.jsonl"
exit $status

#!/usr/bin/env bash
# Packs the GPU test and benchmark binaries built here (CUDA code for sm_90) with the Debian shared
# libraries they link, into .gpu/ferry-gpu.tar.xz, for a GPU machine that lacks ferry's build
# dependencies. bench/gpu/run.sh unpacks it when present, and builds from source otherwise.
# usage: bench/gpu/package.sh [BUILD_DIR] [--python]
#   FERRY_GPU_DIR: the folder to pack into (default .gpu); e.g. .gpu-old for a second build folder of
#   an older commit, which bench/gpu/run.sh runs with FERRY_GPU_DIR=.gpu-old (bench/gpu/before_after.sh).
#   --python: also .gpu/pydeps, pybind11 (from PyPI) and xxhash (this machine's), for
#   bench/gpu/python_pair.sh to build the Python module on a GPU machine without them.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
out=${FERRY_GPU_DIR:-.gpu}
rm -rf "$out/stage" && mkdir -p "$out/stage/bin" "$out/stage/lib"
bins=(core_region_copy_test kernels_quantize_test kernels_exhaustive_test kernels_gptq_test kernels_gemm_test kernels_bad_input_test
      kernels_engine_layout_test kernels_marlin_test kernels_gptq_marlin_test dataplane_delta_test dataplane_delta_threads_test dataplane_tensor_scan_test dataplane_delta_device_test
      reload_gpu_test reload_stability_test reload_oracle_test reload_instrument_test reload_band_test reload_delta_test
      core_buffer_test dataplane_bucket_test transport_conformance_test coordinator_bucket_plan_test
      ferry ferry-demo ferry-tiny-decoder ferry-fault-peer
      ferry-bench-colocated ferry-mpi-example)
for b in "${bins[@]}"; do
  [ -x "$build/bin/$b" ] || continue
  strip -o "$out/stage/bin/$b" "$build/bin/$b"
done
# Shared libraries from this machine's packages; CUDA, NCCL, the driver and Open MPI (whose mpirun
# must match its libraries) come from the GPU machine.
for b in "$out"/stage/bin/*; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE 'libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|ld-linux|libcuda|libnccl|libcudart|libgcc_s|libstdc\+\+|libmpi|libopen-(rte|pal)|libpmix|libhwloc|libevent' |
  while read -r lib; do cp -L "$lib" "$out/stage/lib/"; done
# libstdc++ of GCC 12 is older than the GPU machine's; keep the machine's.
tar -C "$out/stage" -cJf "$out/ferry-gpu.tar.xz" bin lib
rm -rf "$out/stage"
ls -la "$out/ferry-gpu.tar.xz"
if [ "${2:-}" = --python ]; then
  rm -rf "$out/pydeps" && mkdir -p "$out/pydeps/xxhash" /tmp/ferry-pydeps
  python3 -m pip download --no-deps -d /tmp/ferry-pydeps pybind11==2.13.6 > /dev/null
  python3 -m zipfile -e /tmp/ferry-pydeps/pybind11-2.13.6-py3-none-any.whl "$out/pydeps"
  rm -rf "$out/pydeps/pybind11-2.13.6.dist-info"
  cp /usr/include/xxhash.h /usr/include/xxh3.h "$out/pydeps/xxhash/"
  cp -L /usr/lib/x86_64-linux-gnu/libxxhash.so.0 "$out/pydeps/xxhash/"
  ln -sf libxxhash.so.0 "$out/pydeps/xxhash/libxxhash.so"
  du -sh "$out/pydeps"
fi

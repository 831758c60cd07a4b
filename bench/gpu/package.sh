#!/usr/bin/env bash
# Packs the GPU test and benchmark binaries built here (CUDA code for sm_90) with the Debian shared
# libraries they link, into .gpu/ferry-gpu.tar.xz, for a GPU machine that lacks ferry's build
# dependencies. bench/gpu/run.sh unpacks it when present, and builds from source otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
out=.gpu
rm -rf "$out/stage" && mkdir -p "$out/stage/bin" "$out/stage/lib"
bins=(kernels_quantize_test kernels_gptq_test kernels_gemm_test kernels_bad_input_test
      reload_gpu_test reload_stability_test reload_oracle_test reload_instrument_test
      core_buffer_test coordinator_bucket_test transport_conformance_test ferry ferry-demo ferry-tiny-decoder
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

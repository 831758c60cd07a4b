// copy_probe: how close simple streaming kernels come to cudaMemcpy on this GPU, to tell the cost
// of a kernel's memory access pattern from the cost of its arithmetic. Standalone (nvcc only):
//   nvcc -O3 -I. -gencode=arch=compute_90,code=sm_90 -o copy_probe bench/gpu/copy_probe.cu && ./copy_probe
// Prints one JSON line per variant: bytes moved (read + written) per second, and the ratio to
// cudaMemcpyAsync device-to-device of the same input bytes measured in the same run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/gpu/probe_util.cuh"

// 16 bytes per thread per step, grid-stride, `U` steps unrolled with all loads first.
template <int U, bool kStreaming>
__global__ void copy16(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = i + j * stride;
      if (k < n) v[j] = kStreaming ? __ldcs(in + k) : in[k];
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = i + j * stride;
      if (k < n) {
        if (kStreaming) {
          __stcs(out + k, v[j]);
        } else {
          out[k] = v[j];
        }
      }
    }
  }
}

// bf16 -> fp8 codes with a per-row scale given: reads 2 bytes, writes 1 per element (the byte mix
// of a quantize kernel), 8 elements per thread per step.
template <int U>
__global__ void narrow(const uint4* __restrict__ in, uint2* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = i + j * stride;
      if (k < n) v[j] = __ldcs(in + k);
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = i + j * stride;
      if (k < n) {
        // High byte of each bf16: stands in for the encode.
        const uint32_t a = ((v[j].x >> 8) & 0xFF) | ((v[j].x >> 16) & 0xFF00) | (((v[j].y >> 8) & 0xFF) << 16) |
                           (((v[j].y >> 24) & 0xFF) << 24);
        const uint32_t b = ((v[j].z >> 8) & 0xFF) | ((v[j].z >> 16) & 0xFF00) | (((v[j].w >> 8) & 0xFF) << 16) |
                           (((v[j].w >> 24) & 0xFF) << 24);
        __stcs(out + k, make_uint2(a, b));
      }
    }
  }
}

int main() {
  const size_t bytes = size_t{1} << 30;  // 1 GiB of input
  void *in = nullptr, *out = nullptr;
  CK(cudaMalloc(&in, bytes));
  CK(cudaMalloc(&out, bytes));
  CK(cudaMemset(in, 0x3c, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double base = time_ms([&] { CK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice)); });
  const double base_gbps = 2.0 * bytes / base / 1e6;
  std::printf("{\"probe\":\"memcpy\",\"gbps\":%.1f,\"ratio\":1.0}\n", base_gbps);
  const int64_t n16 = bytes / 16;
  auto report = [&](const char* name, double ms, double moved) {
    const double g = moved / ms / 1e6;
    std::printf("{\"probe\":\"%s\",\"gbps\":%.1f,\"ratio\":%.3f}\n", name, g, g / base_gbps);
  };
  for (int per_sm : {4, 8, 16, 32}) {
    const unsigned blocks = static_cast<unsigned>(sms * per_sm);
    char name[64];
    std::snprintf(name, sizeof name, "copy16_u4_cs_grid%dx", per_sm);
    report(name, time_ms([&] { copy16<4, true><<<blocks, 256>>>((const uint4*)in, (uint4*)out, n16); }), 2.0 * bytes);
    std::snprintf(name, sizeof name, "copy16_u4_plain_grid%dx", per_sm);
    report(name, time_ms([&] { copy16<4, false><<<blocks, 256>>>((const uint4*)in, (uint4*)out, n16); }), 2.0 * bytes);
    std::snprintf(name, sizeof name, "narrow_u4_grid%dx", per_sm);
    report(name, time_ms([&] { narrow<4><<<blocks, 256>>>((const uint4*)in, (uint2*)out, n16); }), 1.5 * bytes);
  }
  const unsigned full = static_cast<unsigned>((n16 + 255) / 256);
  report("copy16_u1_full_grid", time_ms([&] { copy16<1, false><<<full, 256>>>((const uint4*)in, (uint4*)out, n16); }),
         2.0 * bytes);
  report("narrow_u1_full_grid", time_ms([&] { narrow<1><<<full, 256>>>((const uint4*)in, (uint2*)out, n16); }),
         1.5 * bytes);
  CK(cudaDeviceSynchronize());
  return 0;
}

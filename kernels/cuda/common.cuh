// Helpers of the CUDA kernels: 16-element loads (two or four 16-byte loads when aligned), block
// reductions, launch checks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/float_convert.h"
#include "core/status.h"

namespace ferry::kernels::detail::cuda {

inline constexpr int kThreads = 256;
inline constexpr int kVec = 16;  // elements per thread per step

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

#define FERRY_CUDA_LAUNCH_CHECK() FERRY_CUDA_CHECK(cudaGetLastError())

// fn(std::integral_constant<DType, D>{}) for the float input dtype `dt` (f32, bf16, f16): a kernel's
// launch instance per input dtype.
template <typename Fn>
Status by_float_dtype(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kBF16: return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16: return fn(std::integral_constant<DType, DType::kF16>{});
    default: return fn(std::integral_constant<DType, DType::kF32>{});
  }
}

template <DType D>
__device__ __forceinline__ float load1(const void* p, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

__device__ __forceinline__ float half_of(uint32_t word, int hi, bool bf16) {
  const uint16_t h = static_cast<uint16_t>(hi ? (word >> 16) : (word & 0xFFFFu));
  return bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Elements i .. i+15 of p. `vec`: p + i is 16-byte aligned and all 16 lie in bounds. Otherwise only
// the first `n` (<= 16) are loaded and the rest set to 0.
template <DType D>
__device__ __forceinline__ void load16(const void* p, int64_t i, bool vec, int n, float (&v)[kVec]) {
  if (vec) {
    if constexpr (D == DType::kF32) {
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const float*>(p) + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 u = __ldg(q + j);
        v[4 * j + 0] = __uint_as_float(u.x);
        v[4 * j + 1] = __uint_as_float(u.y);
        v[4 * j + 2] = __uint_as_float(u.z);
        v[4 * j + 3] = __uint_as_float(u.w);
      }
    } else {
      constexpr bool kBf16 = D == DType::kBF16;
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 u = __ldg(q + j);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          v[8 * j + 2 * t] = half_of(w[t], 0, kBf16);
          v[8 * j + 2 * t + 1] = half_of(w[t], 1, kBf16);
        }
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = j < n ? load1<D>(p, i + j) : 0.0f;
}

// 16 bytes to p (16-byte aligned when vec), or the first n bytes one by one.
__device__ __forceinline__ void store16_bytes(uint8_t* p, bool vec, int n, const uint8_t (&b)[kVec]) {
  if (vec) {
    uint4 u;
    u.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    u.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
    u.z = b[8] | (b[9] << 8) | (b[10] << 16) | (static_cast<uint32_t>(b[11]) << 24);
    u.w = b[12] | (b[13] << 8) | (b[14] << 16) | (static_cast<uint32_t>(b[15]) << 24);
    *reinterpret_cast<uint4*>(p) = u;
    return;
  }
  for (int j = 0; j < n; ++j) p[j] = b[j];
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  __shared__ float result;
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : 0.0f;
    m = warp_max(m);
    if (lane == 0) result = m;
  }
  __syncthreads();
  const float r = result;
  __syncthreads();  // partial and result may be reused by the next call
  return r;
}

// Elements of input dtype D in one 16-byte vector.
template <DType D>
inline constexpr int kPerVec = D == DType::kF32 ? 4 : 8;

// The kPerVec floats of one 16-byte vector of D.
template <DType D>
__device__ __forceinline__ void unpack(const uint4& u, float (&v)[kPerVec<D>]) {
  if constexpr (D == DType::kF32) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
  } else {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      v[2 * t] = half_of(w[t], 0, D == DType::kBF16);
      v[2 * t + 1] = half_of(w[t], 1, D == DType::kBF16);
    }
  }
}

// 4 or 8 one-byte codes to p (aligned to their size), streaming (the output is not read again).
template <int N>
__device__ __forceinline__ void store_codes(uint8_t* p, const uint8_t (&b)[N]) {
  static_assert(N == 4 || N == 8);
  const uint32_t lo = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  if constexpr (N == 4) {
    __stcs(reinterpret_cast<unsigned int*>(p), lo);
  } else {
    const uint32_t hi = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(lo, hi));
  }
}

// Blocks of kThreads for a grid-stride kernel: enough to fill every SM at the kernel's occupancy,
// never more than the work has (`work_blocks`), at least 1.
unsigned persistent_blocks(const void* kernel, int64_t work_blocks, size_t smem = 0);

}  // namespace ferry::kernels::detail::cuda

// Fast paths of the quantize kernels, bit-identical to ops::finite_abs / quant_int (the
// CUDA-vs-CPU tests compare every scheme bit for bit). Profiling on the H200 showed the row kernels
// bound by instruction issue, not memory: the per-element float max with its finiteness test and
// the correctly rounded division by the scale cost more issue slots than the bytes allow.
//
//  - amax: the magnitude of a bf16 is its bits & 0x7FFF, and non-negative floats order like their
//    bits, so two elements take one AND and one 16x2 integer max. A non-finite element shows as bits
//    >= 0x7F80; only then is the slow float path taken (it leaves them out, as finite_abs does).
//  - division (int8, int4): q = x * r with r = 1/s rounded is within 2 ulps of x / s rounded. Codes
//    differ only if the two straddle a rounding midpoint k + 1/2, so elements whose q lies that
//    close to one take the exact division; anything else rounds to the same code from either
//    value. (The same for fp8, with its midpoints and subnormal grid, measured slower than the
//    hardware division plus conversion: 0.61 against 0.83 of the device copy, bench/gpu/quant_probe.cu.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {

// Running max of |bf16| bits over the two halves of each word.
__device__ __forceinline__ uint32_t absmax_bf16x2(uint32_t acc, uint32_t word) {
  return __vmaxu2(acc, word & 0x7FFF7FFFu);
}

// The reciprocal used by quant_int_fast, or 0 when the scale is outside the range where x * r is
// within 2 ulps of x / s (then every element takes the exact division).
__device__ __forceinline__ float fast_recip(float s) {
  const float r = 1.0f / s;
  const bool ok = s >= 1.0e-30f && s <= 1.0e30f && r >= 1.0e-30f && r <= 1.0e30f;
  return ok ? r : 0.0f;
}

// ops::quant_int(x, s, lo, hi), given r = fast_recip(s). The product v = x * r lies within 2 ulps of
// the rounded quotient x / s; both round to the same integer unless a half lies between them, and
// for |v| < 2^9 two ulps are below 2^-15, so only a product within 2^-14 of a half (or NaN, where d
// is NaN too; or r = 0) takes the exact division. Rounding, then clamping to the integer bounds,
// equals clamping, then rounding. (Measured on the H200: int8_per_channel 0.73 -> 0.84 of the
// device copy against the previous form, which clamped and tested every element in float.)
__device__ __forceinline__ int32_t quant_int_fast(float x, float s, float r, float lo, float hi) {
  const float v = x * r;
  const float n = rintf(v);
  if (!(fabsf(v - n) < 0.49993896f) || r == 0.0f) return ops::quant_int(x, s, lo, hi);
  return static_cast<int32_t>(fminf(fmaxf(n, lo), hi));
}

// max |x| over the finite elements of `raw` (bf16: absmax_bf16x2 above, falling back to floats
// only when an inf or NaN is among them).
template <DType D, int N>
__device__ __forceinline__ float vec_amax(const uint4 (&raw)[N]) {
  constexpr int E = kPerVec<D>;
  if constexpr (D == DType::kBF16) {
    uint32_t acc = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      acc = absmax_bf16x2(acc, raw[j].x);
      acc = absmax_bf16x2(acc, raw[j].y);
      acc = absmax_bf16x2(acc, raw[j].z);
      acc = absmax_bf16x2(acc, raw[j].w);
    }
    const uint32_t m16 = max(acc & 0xFFFFu, acc >> 16);
    if (m16 < 0x7F80u) return __uint_as_float(m16 << 16);
  }
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float f[E];
    unpack<D>(raw[j], f);
#pragma unroll
    for (int e = 0; e < E; ++e) m = fmaxf(m, ops::finite_abs(f[e]));
  }
  return m;
}

}  // namespace ferry::kernels::detail::cuda

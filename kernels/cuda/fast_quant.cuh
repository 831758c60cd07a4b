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
//  - fp8 codes of elements known finite (fp8_encode_fast): the division's fast path with the scale's
//    reciprocal refined once, without its per-element range test and branch, or the engines'
//    x * (1 / s) as they write it; converted in hardware on Ada and later.
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

// Running max of the magnitude bits of D's elements (non-negative floats order like their bits).
template <DType D>
__device__ __forceinline__ uint32_t magnitude_max(uint32_t acc, const uint4& r) {
  if constexpr (D == DType::kF32) {
    acc = max(acc, r.x & 0x7FFFFFFFu);
    acc = max(acc, r.y & 0x7FFFFFFFu);
    acc = max(acc, r.z & 0x7FFFFFFFu);
    return max(acc, r.w & 0x7FFFFFFFu);
  } else {
    acc = __vmaxu2(acc, r.x & 0x7FFF7FFFu);
    acc = __vmaxu2(acc, r.y & 0x7FFF7FFFu);
    acc = __vmaxu2(acc, r.z & 0x7FFF7FFFu);
    return __vmaxu2(acc, r.w & 0x7FFF7FFFu);
  }
}

// The largest magnitude in `acc`, and whether it is an inf or NaN.
template <DType D>
__device__ __forceinline__ float magnitude_value(uint32_t acc, bool& nonfinite) {
  if constexpr (D == DType::kF32) {
    nonfinite = acc >= 0x7F800000u;
    return __uint_as_float(acc);
  } else {
    const uint32_t m = max(acc & 0xFFFFu, acc >> 16);
    nonfinite = m >= (D == DType::kBF16 ? 0x7F80u : 0x7C00u);
    return D == DType::kBF16 ? __uint_as_float(m << 16) : f16_to_f32(static_cast<uint16_t>(m));
  }
}

// The multiplier y of fp8_encode_fast for finite elements under scale s (inv: ops::fp8_multiplier),
// or 0 when every element must take ops::quant_fp8 instead:
//  - a dividing rule (x / s): 1/s refined once, for s in [2^-60, 2^60]. Per element q = x*y,
//    r = x - s*q (exact), q + r*y: the division's own fast path, which gives the correctly rounded
//    quotient for every finite x there; quotients below 2^-12 may come out inexact, but they are
//    signed zeros in e4m3 either way (copysign mends -0, for which the sum is +0).
//  - a reciprocal rule (x * inv): inv itself when it is finite and not 0; the codes of x * inv are
//    then what the rule defines, with no NaN among them.
__device__ __forceinline__ float fp8_fast_multiplier(float s, float inv, const ops::Fp8Rule& r) {
  if (r.reciprocal) return inv != 0.0f && fabsf(inv) <= ops::kFltMax ? inv : 0.0f;
  if (!(s >= 0x1p-60f && s <= 0x1p60f)) return 0.0f;
  float y0;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(s));
  return fmaf(y0, fmaf(-s, y0, 1.0f), y0);
}

// The codes of one vector of finite elements (y: fp8_fast_multiplier, not 0); kMul: the rule is a
// reciprocal one. Streaming stores (the output is not read again).
template <DType D, bool kMul>
__device__ __forceinline__ void fp8_encode_fast(const uint4& raw, float s, float y, uint8_t* dst) {
  constexpr int E = kPerVec<D>;
  float f[E];
  unpack<D>(raw, f);
  float v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float q = f[e] * y;
    v[e] = kMul ? q : copysignf(fmaf(fmaf(-s, q, f[e]), y, q), f[e]);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t w[E / 4];
#pragma unroll
  for (int k = 0; k < E / 4; ++k) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[4 * k + 1]), "f"(v[4 * k]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[4 * k + 3]), "f"(v[4 * k + 2]));
    w[k] = lo | (static_cast<uint32_t>(hi) << 16);
  }
  if constexpr (E == 4) {
    __stcs(reinterpret_cast<unsigned int*>(dst), w[0]);
  } else {
    __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]));
  }
#else
  uint8_t b[E];
#pragma unroll
  for (int e = 0; e < E; ++e) b[e] = ops::e4m3_rne(v[e]);
  store_codes<E>(dst, b);
#endif
}

}  // namespace ferry::kernels::detail::cuda

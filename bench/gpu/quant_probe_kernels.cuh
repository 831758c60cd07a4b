// The kernel variants bench/gpu/quant_probe.cu runs side by side: row-scaled (fp8/int8 per
// channel), fp8 per tensor (amax, then encode) and int4 group, each in the shape ferry's kernels had
// when the probe was written ("cur") and in candidate shapes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/scalar_ops.h"

namespace ops = ferry::kernels::ops;
constexpr int kT = 256;

__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    f[2 * t] = lo_f(w[t]);
    f[2 * t + 1] = hi_f(w[t]);
  }
}

// The largest magnitude bits of the bf16 elements of `raw` (0x7F80 and above: an inf or NaN).
template <int N>
__device__ __forceinline__ uint32_t max_bits(const uint4 (&raw)[N]) {
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    acc = __vmaxu2(acc, raw[j].x & 0x7FFF7FFFu);
    acc = __vmaxu2(acc, raw[j].y & 0x7FFF7FFFu);
    acc = __vmaxu2(acc, raw[j].z & 0x7FFF7FFFu);
    acc = __vmaxu2(acc, raw[j].w & 0x7FFF7FFFu);
  }
  return max(acc & 0xFFFFu, acc >> 16);
}

template <int N>
__device__ __forceinline__ float amax_bits(const uint4 (&raw)[N]) {
  const uint32_t m16 = max_bits(raw);
  if (m16 < 0x7F80u) return __uint_as_float(m16 << 16);
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float f[8];
    unpack8(raw[j], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, ops::finite_abs(f[e]));
  }
  return m;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float recip_or_zero(float s) {
  const float r = 1.0f / s;
  const bool ok = s >= 1.0e-30f && s <= 1.0e30f && r >= 1.0e-30f && r <= 1.0e30f;
  return ok ? r : 0.0f;
}

// ferry's quant_int_fast at the time of the probe.
__device__ __forceinline__ int32_t int_cur(float x, float s, float r, float lo, float hi) {
  float v = x * r;
  v = (v == v) ? v : 0.0f;
  v = fminf(fmaxf(v, lo), hi);
  const float n = (v + 12582912.0f) - 12582912.0f;
  if (r == 0.0f || fabsf(fabsf(v - n) - 0.5f) <= fabsf(v) * 1.0e-6f) return ops::quant_int(x, s, lo, hi);
  return static_cast<int32_t>(n);
}

// Candidate: round x * r to an integer; only where the product lies within 2^-14 of a half (two
// ulps at |v| < 2^9 are far less), or is NaN (d is then NaN), or r is 0, take the exact division.
__device__ __forceinline__ int32_t int_new(float x, float s, float r, float lo, float hi) {
  const float v = x * r;
  const float n = rintf(v);
  const float d = fabsf(v - n);
  if (!(d < 0.49993896f) || r == 0.0f) return ops::quant_int(x, s, lo, hi);
  return static_cast<int32_t>(fminf(fmaxf(n, lo), hi));
}

// Candidate fp8: x * r converted in hardware, unless the product lies within 3 ulps of an e4m3
// rounding midpoint (the 20 bits e4m3 drops near 0x80000), is below the e4m3 normal range, or is NaN.
__device__ __forceinline__ bool fp8_needs_exact(float v) {
  const uint32_t a = __float_as_uint(v) & 0x7FFFFFFFu;
  return ((a + 3u - 0x80000u) & 0xFFFFFu) <= 6u || a < 0x3C800000u || a > 0x7F800000u;
}

enum Mode { kFp8Div, kFp8Mul, kInt8Cur, kInt8New };

template <int M>
__device__ __forceinline__ void encode8(const uint4& raw, float s, float r, uint8_t* dst) {
  float f[8];
  unpack8(raw, f);
  uint32_t lo = 0, hi = 0;
  if constexpr (M == kFp8Div) {
    uint8_t b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = ops::quant_fp8(f[e], s);
    lo = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t(b[3]) << 24);
    hi = b[4] | (b[5] << 8) | (b[6] << 16) | (uint32_t(b[7]) << 24);
  } else if constexpr (M == kFp8Mul) {
    float v[8];
    bool slow = r == 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      v[e] = f[e] * r;
      slow |= fp8_needs_exact(v[e]);
    }
    uint8_t b[8];
    if (slow) {
#pragma unroll
      for (int e = 0; e < 8; ++e) b[e] = fp8_needs_exact(v[e]) || r == 0.0f ? ops::quant_fp8(f[e], s) : ops::e4m3_rne(v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) b[e] = ops::e4m3_rne(v[e]);
    }
    lo = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t(b[3]) << 24);
    hi = b[4] | (b[5] << 8) | (b[6] << 16) | (uint32_t(b[7]) << 24);
  } else {
    uint8_t b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      b[e] = static_cast<uint8_t>(static_cast<int8_t>(M == kInt8Cur ? int_cur(f[e], s, r, -127.0f, 127.0f)
                                                                   : int_new(f[e], s, r, -127.0f, 127.0f)));
    }
    lo = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t(b[3]) << 24);
    hi = b[4] | (b[5] << 8) | (b[6] << 16) | (uint32_t(b[7]) << 24);
  }
  __stcs(reinterpret_cast<uint2*>(dst), make_uint2(lo, hi));
}

template <int M>
__device__ __forceinline__ float row_scale(float m) {
  return (M == kInt8Cur || M == kInt8New) ? ops::int8_scale(m) : ops::fp8_scale(m);
}

// "cur": TPR threads per row, V vectors each, one row group per block, loads first.
template <int M, int TPR, int V, int MINB = 1>
__global__ void __launch_bounds__(kT, MINB) rows_cur(const uint4* in, uint8_t* out, float* scale, int64_t rows, int64_t nv) {
  __shared__ float wa[kT / 32];
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kT / TPR) + g;
  const bool live = r < rows;
  const uint4* src = in + (live ? r : 0) * nv;
  uint4 raw[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t v = int64_t{j} * TPR + lane;
    raw[j] = live && v < nv ? __ldcs(src + v) : make_uint4(0, 0, 0, 0);
  }
  float m = warp_max(amax_bits(raw));
  if ((threadIdx.x & 31) == 0) wa[threadIdx.x >> 5] = m;
  __syncthreads();
  for (int w = 0; w < TPR / 32; ++w) m = fmaxf(m, wa[g * (TPR / 32) + w]);
  if (!live) return;
  const float s = row_scale<M>(m);
  const float rr = recip_or_zero(s);
  if (lane == 0) scale[r] = s;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t v = int64_t{j} * TPR + lane;
    if (v < nv) encode8<M>(raw[j], s, rr, out + (r * nv + v) * 8);
  }
}

// "pipe": persistent blocks of one row at a time (TPR = kT); the next row's loads are issued before
// this row's reduction and encode, so loads stay in flight through the arithmetic.
template <int M, int V, int MINB = 1>
__global__ void __launch_bounds__(kT, MINB) rows_pipe(const uint4* in, uint8_t* out, float* scale, int64_t rows, int64_t nv) {
  __shared__ float wa[2][kT / 32];
  const int lane = threadIdx.x;
  int64_t r = blockIdx.x;
  uint4 cur[V], nxt[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t v = int64_t{j} * kT + lane;
    cur[j] = r < rows && v < nv ? __ldcs(in + r * nv + v) : make_uint4(0, 0, 0, 0);
  }
  for (int it = 0; r < rows; r += gridDim.x, ++it) {
    const int64_t rn = r + gridDim.x;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t v = int64_t{j} * kT + lane;
      nxt[j] = rn < rows && v < nv ? __ldcs(in + rn * nv + v) : make_uint4(0, 0, 0, 0);
    }
    float m = warp_max(amax_bits(cur));
    if ((threadIdx.x & 31) == 0) wa[it & 1][threadIdx.x >> 5] = m;
    __syncthreads();  // wa[it & 1] is rewritten two rows later, after the next barrier
#pragma unroll
    for (int w = 0; w < kT / 32; ++w) m = fmaxf(m, wa[it & 1][w]);
    const float s = row_scale<M>(m);
    const float rr = recip_or_zero(s);
    if (lane == 0) scale[r] = s;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t v = int64_t{j} * kT + lane;
      if (v < nv) encode8<M>(cur[j], s, rr, out + (r * nv + v) * 8);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) cur[j] = nxt[j];
  }
}

// fp8_per_tensor: amax pass (U vectors per thread per step), then encode in reverse chunk order.
template <int U, bool kEvictLastTail>
__global__ void __launch_bounds__(kT) tensor_amax(const uint4* in, int64_t nv, int64_t tail_from, float* slot) {
  float m = 0.0f;
  const int64_t step = int64_t{gridDim.x} * kT * U;
  for (int64_t v = int64_t{blockIdx.x} * kT * U + threadIdx.x; v < nv; v += step) {
    uint4 raw[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t i = v + j * kT;
      if (i >= nv) {
        raw[j] = make_uint4(0, 0, 0, 0);
      } else if (kEvictLastTail && i >= tail_from) {
        uint64_t policy;
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
        uint4 u;
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                     : "l"(in + i), "l"(policy));
        raw[j] = u;
      } else if (kEvictLastTail) {
        raw[j] = __ldcs(in + i);
      } else {
        raw[j] = __ldg(in + i);
      }
    }
    m = fmaxf(m, amax_bits(raw));
  }
  __shared__ float part[kT / 32];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kT / 32; ++w) m = fmaxf(m, part[w]);
    atomicMax(reinterpret_cast<unsigned int*>(slot), __float_as_uint(m));
  }
}

__global__ void finalize(float* slot) { *slot = ops::fp8_scale(*slot); }

template <int M, int U>
__global__ void __launch_bounds__(kT) tensor_encode(const uint4* in, uint8_t* out, int64_t nv, const float* slot) {
  constexpr int64_t kChunk = int64_t{kT} * U;
  const int64_t chunks = (nv + kChunk - 1) / kChunk;
  const float s = *slot;
  const float rr = recip_or_zero(s);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t first = (chunks - 1 - c) * kChunk + threadIdx.x;
    uint4 raw[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t i = first + j * kT;
      raw[j] = i < nv ? __ldcs(in + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t i = first + j * kT;
      if (i < nv) encode8<M>(raw[j], s, rr, out + i * 8);
    }
  }
}

// int4_group: 8 lanes per 128-column group, 16 columns (two vectors) each.
// "cur": ferry's kernel at the time of the probe (float amax, quant_int_fast), one slice per thread.
__global__ void __launch_bounds__(kT) int4_cur(const uint4* in, uint2* out, uint16_t* scale, int64_t groups) {
  const int64_t t = int64_t{blockIdx.x} * kT + threadIdx.x;
  const int64_t g = t / 8;
  const bool active = g < groups;
  uint4 raw[2] = {active ? __ldg(in + 2 * t) : make_uint4(0, 0, 0, 0), active ? __ldg(in + 2 * t + 1) : make_uint4(0, 0, 0, 0)};
  float v[16];
  unpack8(raw[0], *reinterpret_cast<float(*)[8]>(v));
  unpack8(raw[1], *reinterpret_cast<float(*)[8]>(v + 8));
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) m = fmaxf(m, ops::finite_abs(v[j]));
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!active) return;
  const uint16_t s16 = ops::int4_scale_f16(m);
  if (t % 8 == 0) scale[g] = s16;
  const float s = ferry::f16_to_f32(s16);
  const float rs = recip_or_zero(s);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) lo |= static_cast<uint32_t>(int_cur(v[j], s, rs, -8.0f, 7.0f) & 0xF) << (4 * j);
#pragma unroll
  for (int j = 0; j < 8; ++j) hi |= static_cast<uint32_t>(int_cur(v[8 + j], s, rs, -8.0f, 7.0f) & 0xF) << (4 * j);
  __stcs(out + t, make_uint2(lo, hi));
}

// "new": integer amax on raw bf16 bits, int_new rounding, U slices per thread with all loads first.
template <int U>
__global__ void __launch_bounds__(kT) int4_new(const uint4* in, uint2* out, uint16_t* scale, int64_t groups) {
  const int64_t slices = groups * 8;
  const int64_t stride = int64_t{gridDim.x} * kT;
  for (int64_t t0 = int64_t{blockIdx.x} * kT + threadIdx.x; t0 - threadIdx.x < slices; t0 += stride * U) {
    uint4 raw[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + u * stride;
      raw[u][0] = t < slices ? __ldcs(in + 2 * t) : make_uint4(0, 0, 0, 0);
      raw[u][1] = t < slices ? __ldcs(in + 2 * t + 1) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + u * stride;
      float m = amax_bits(raw[u]);
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (t >= slices) continue;
      const uint16_t s16 = ops::int4_scale_f16(m);
      if (t % 8 == 0) scale[t / 8] = s16;
      const float s = ferry::f16_to_f32(s16);
      const float rs = recip_or_zero(s);
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float f[8];
        unpack8(raw[u][h], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[h] |= static_cast<uint32_t>(int_new(f[j], s, rs, -8.0f, 7.0f) & 0xF) << (4 * j);
      }
      __stcs(out + t, make_uint2(w[0], w[1]));
    }
  }
}


// The one-kernel fp8_per_tensor variants bench/gpu/quant_probe.cu runs (split from
// quant_probe_kernels.cuh, whose helpers they use).
#pragma once

#include "bench/gpu/quant_probe_kernels.cuh"
#include "kernels/cuda/bulk_copy.cuh"

// fp8_per_tensor in one cooperative kernel ("fused"; ferry's kernels/cuda/quantize_tensor.cu grew
// from it): one block per SM streams its contiguous range of the input through a ring of kStages
// shared-memory slots with 1-D bulk copies (TMA); the last kStages chunks stay in shared memory.
// After a grid barrier (the tensor's amax), the block encodes those chunks first, then the rest of
// its range from its end back to its start. kHint: pass-1 loads of the kL2 chunks before the
// resident ones ask L2 to keep them (evict_last), every other load is evict_first.
// kEncode: how pass 2 turns values into codes (see encode_* below).
namespace fused {

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

using ferry::kernels::detail::cuda::bulk_load;
using ferry::kernels::detail::cuda::mbar_init;
using ferry::kernels::detail::cuda::mbar_wait;
__device__ __forceinline__ uint64_t policy_first() { return ferry::kernels::detail::cuda::l2_evict_first(); }
__device__ __forceinline__ uint64_t policy_last() { return ferry::kernels::detail::cuda::l2_evict_last(); }
__device__ __forceinline__ uint64_t policy_normal() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint32_t cvt_e4m3x2(float hi, float lo) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// kEncDiv: the hardware division (encode8<kFp8Div>, as the two-kernel "cur"). kEncConst: a
// stand-in for the codes (memory traffic only; wrong codes). kEncFma: the division's fast path with
// the reciprocal refined once per tensor and no per-element range test (the probe takes it for any
// scale; ferry only for s in [2^-60, 2^60] and no inf or NaN). Measured on the H200 before it was
// kept, pass 2 of 128 MiB: division 57 us, x * (1/s) with an integer midpoint test per element
// (the test written with branches, branch-free, deferred, or as a bracket of two conversions) 78 to
// 253 us, the division's fast path with its per-element range selects 45 us, kEncFma 39 us,
// kEncConst 38 us.
enum Encode { kEncDiv, kEncConst, kEncFma };

__device__ __forceinline__ void encode8_fma(const uint4& raw, float s, float y, uint8_t* dst) {
  float f[8];
  unpack8(raw, f);
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float q = f[e] * y;
    v[e] = copysignf(fmaf(fmaf(-s, q, f[e]), y, q), f[e]);
  }
  const uint32_t lo = cvt_e4m3x2(v[1], v[0]) | (cvt_e4m3x2(v[3], v[2]) << 16);
  const uint32_t hi = cvt_e4m3x2(v[5], v[4]) | (cvt_e4m3x2(v[7], v[6]) << 16);
  __stcs(reinterpret_cast<uint2*>(dst), make_uint2(lo, hi));
}

// counter[0]: blocks past the amax; counter[1]: blocks done with it (the last resets both and the
// slot). times (optional): per block, the globaltimer at its start, after the barrier, at its end.
template <int kThreadsF, int kStages, int kChunkVecs, int kHint, int kL2, int kEncode>
__global__ void __launch_bounds__(kThreadsF, 1)
    tensor_fused(const uint4* in, uint8_t* out, int64_t nv, float* slot, unsigned* counter, float* scale_out,
                 unsigned long long* times) {
  auto stamp = [&](int i) {
    if (times != nullptr && threadIdx.x == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
      times[3 * blockIdx.x + i] = t;
    }
  };
  stamp(0);
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ uint64_t bars[kStages];
  __shared__ float part[kThreadsF / 32];
  __shared__ float s_scale;
  const int64_t chunks = (nv + kChunkVecs - 1) / kChunkVecs;
  const int64_t c0 = chunks * blockIdx.x / gridDim.x, c1 = chunks * (blockIdx.x + 1) / gridDim.x;
  const int64_t m = c1 - c0;
  if (threadIdx.x == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(&bars[k]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t parity = 0;  // bit k: the phase slot k waits for next
  auto chunk_vecs = [&](int64_t c) { return static_cast<int>(imin64(kChunkVecs, nv - (c0 + c) * kChunkVecs)); };
  auto issue = [&](int64_t c, uint64_t policy) {
    const int k = static_cast<int>(c % kStages);
    bulk_load(ring + int64_t{k} * kChunkVecs, in + (c0 + c) * kChunkVecs, static_cast<uint32_t>(chunk_vecs(c)) * 16u,
              &bars[k], policy);
  };
  auto pass1_policy = [&](int64_t c) {
    if (kHint == 0) return policy_normal();
    return (c < m - kStages && c >= m - kStages - kL2) ? policy_last() : policy_first();
  };
  if (threadIdx.x == 0) {
    for (int64_t c = 0; c < m && c < kStages; ++c) issue(c, pass1_policy(c));
  }
  uint32_t acc = 0;
  for (int64_t c = 0; c < m; ++c) {
    const int k = static_cast<int>(c % kStages);
    mbar_wait(&bars[k], (parity >> k) & 1u);
    parity ^= 1u << k;
    const uint4* src = ring + int64_t{k} * kChunkVecs;
    const int n = chunk_vecs(c);
    for (int i = threadIdx.x; i < n; i += kThreadsF) {
      const uint4 r = src[i];
      acc = __vmaxu2(acc, r.x & 0x7FFF7FFFu);
      acc = __vmaxu2(acc, r.y & 0x7FFF7FFFu);
      acc = __vmaxu2(acc, r.z & 0x7FFF7FFFu);
      acc = __vmaxu2(acc, r.w & 0x7FFF7FFFu);
    }
    if (c + kStages < m) {
      __syncthreads();  // every thread is done with slot k
      if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(c + kStages, pass1_policy(c + kStages));
      }
    }
  }
  // The probe's inputs hold no inf or NaN (ferry's kernel takes the amax again in floats if they do).
  float mx = __uint_as_float(max(acc & 0xFFFFu, acc >> 16) << 16);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsF / 32; ++w) mx = fmaxf(mx, part[w]);
    atomicMax(reinterpret_cast<unsigned*>(slot), __float_as_uint(mx));
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < gridDim.x);
    float a;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(a) : "l"(slot) : "memory");
    s_scale = ops::fp8_scale(a);
    if (blockIdx.x == 0) *scale_out = s_scale;
    if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) {  // every block has read the slot
      *slot = 0.0f;
      counter[0] = 0;
      counter[1] = 0;
    }
  }
  __syncthreads();
  stamp(1);
  const float s = s_scale;
  float y0;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(s));
  const float y = fmaf(y0, fmaf(-s, y0, 1.0f), y0);
  // Pass 2: chunks m-1 down to 0; chunk c sits in slot c % kStages (the resident ones already).
  const uint64_t pf = policy_first();
  for (int64_t c = m - 1; c >= 0; --c) {
    const int k = static_cast<int>(c % kStages);
    if (c < m - kStages) {
      mbar_wait(&bars[k], (parity >> k) & 1u);
      parity ^= 1u << k;
    }
    const uint4* src = ring + int64_t{k} * kChunkVecs;
    const int n = chunk_vecs(c);
    uint8_t* dst = out + (c0 + c) * kChunkVecs * 8;
    if constexpr (kEncode == kEncFma) {
      for (int i = threadIdx.x; i < n; i += kThreadsF) encode8_fma(src[i], s, y, dst + int64_t{i} * 8);
    } else if constexpr (kEncode == kEncConst) {
      for (int i = threadIdx.x; i < n; i += kThreadsF) {
        const uint4 r = src[i];
        __stcs(reinterpret_cast<uint2*>(dst + int64_t{i} * 8), make_uint2(r.x ^ r.y, r.z ^ r.w));
      }
    } else {
      for (int i = threadIdx.x; i < n; i += kThreadsF) encode8<kFp8Div>(src[i], s, 0.0f, dst + int64_t{i} * 8);
    }
    if (c >= kStages) {
      __syncthreads();
      if (threadIdx.x == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(c - kStages, pf);
      }
    }
  }
  stamp(2);
}

}  // namespace fused

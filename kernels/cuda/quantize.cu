// CUDA quantize kernels. Per-row and per-block schemes read their input once (the values stay in
// registers between amax and quantize, or are re-read from L1/L2 for very long rows);
// fp8_per_tensor reads it twice: amax, then quantize.
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/internal.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

// Row modes of row_kernel.
enum RowMode : int { kFp8Channel, kInt8Channel, kAmaxOnly, kFp8Given };
inline constexpr int kCacheSegs = 2;  // 16-element segments a thread keeps in registers

struct RowParams {
  const void* in;
  void* out;
  float* scale;  // per-row scales, or the shard's scale/amax slot
  int64_t row0;  // first row handled (shards)
  int64_t cols;
  bool vec;  // input and output rows are 16-byte aligned and cols % 16 == 0
};

template <int kMode>
__device__ __forceinline__ uint8_t quant_byte(float x, float s) {
  if constexpr (kMode == kInt8Channel) {
    return static_cast<uint8_t>(ops::quant_int8(x, s));
  } else {
    return ops::quant_fp8(x, s);
  }
}

// One block per row.
template <DType D, int kMode>
__global__ void __launch_bounds__(kThreads) row_kernel(RowParams p) {
  const int64_t r = p.row0 + blockIdx.x;
  const int64_t base = r * p.cols;
  const int64_t segs = (p.cols + kVec - 1) / kVec;
  float cache[kCacheSegs][kVec];
  float m = 0.0f;
  if constexpr (kMode != kFp8Given) {
    int slot = 0;
    for (int64_t s = threadIdx.x; s < segs; s += blockDim.x, ++slot) {
      const int64_t c = s * kVec;
      const int n = static_cast<int>(imin(kVec, p.cols - c));
      float v[kVec];
      load16<D>(p.in, base + c, p.vec, n, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = fmaxf(m, ops::finite_abs(v[j]));
      if (slot < kCacheSegs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) cache[slot][j] = v[j];
      }
    }
    m = block_max(m);
  }
  if constexpr (kMode == kAmaxOnly) {
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(p.scale), __float_as_uint(m));
    return;
  } else {
    float scale;
    if constexpr (kMode == kFp8Given) {
      scale = *p.scale;
    } else {
      scale = kMode == kInt8Channel ? ops::int8_scale(m) : ops::fp8_scale(m);
      if (threadIdx.x == 0) p.scale[r] = scale;
    }
    uint8_t* out = static_cast<uint8_t*>(p.out) + base;
    int slot = 0;
    for (int64_t s = threadIdx.x; s < segs; s += blockDim.x, ++slot) {
      const int64_t c = s * kVec;
      const int n = static_cast<int>(imin(kVec, p.cols - c));
      float v[kVec];
      if (kMode != kFp8Given && slot < kCacheSegs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = cache[slot][j];
      } else {
        load16<D>(p.in, base + c, p.vec, n, v);
      }
      uint8_t b[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = quant_byte<kMode>(v[j], scale);
      store16_bytes(out + c, p.vec, n, b);
    }
  }
}

__global__ void finalize_fp8_scale(float* scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) scale[i] = ops::fp8_scale(scale[i]);  // the slot holds amax until here
}

// One block per 128x128 tile; each thread keeps its 4 segments in registers.
template <DType D>
__global__ void __launch_bounds__(kThreads) block_kernel(const void* in, uint8_t* out, float* scale, int64_t rows,
                                                         int64_t cols, bool vec) {
  constexpr int kSegsPerRow = kFp8BlockSize / kVec;                         // 8
  constexpr int kPerThread = kFp8BlockSize * kSegsPerRow / kThreads;        // 4
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kFp8BlockSize;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kFp8BlockSize;
  float v[kPerThread][kVec];
  int64_t at[kPerThread];
  int cnt[kPerThread];
  float m = 0.0f;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int seg = threadIdx.x + t * kThreads;
    const int64_t r = r0 + seg / kSegsPerRow, c = c0 + (seg % kSegsPerRow) * kVec;
    const int n = (r < rows && c < cols) ? static_cast<int>(imin(kVec, cols - c)) : 0;
    at[t] = r * cols + c;
    cnt[t] = n;
    load16<D>(in, at[t], vec && n == kVec, n, v[t]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = fmaxf(m, ops::finite_abs(v[t][j]));
  }
  const float s = ops::fp8_scale(block_max(m));
  if (threadIdx.x == 0) scale[blockIdx.y * gridDim.x + blockIdx.x] = s;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    uint8_t b[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = ops::quant_fp8(v[t][j], s);
    if (cnt[t] > 0) store16_bytes(out + at[t], vec && cnt[t] == kVec, cnt[t], b);
  }
}

// Eight lanes per 128-column group, 16 columns each; the group's amax is reduced over the 8 lanes.
template <DType D>
__global__ void __launch_bounds__(kThreads) int4_kernel(const void* in, uint8_t* out, uint16_t* scale,
                                                        int64_t total_groups, int64_t cols, bool vec_in,
                                                        bool vec_out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t g = t / 8;
  const int lane8 = static_cast<int>(t % 8);
  const bool active = g < total_groups;
  const int64_t groups_per_row = cols / kInt4GroupSize;
  const int64_t r = g / groups_per_row, gc = g % groups_per_row;
  const int64_t i = r * cols + gc * kInt4GroupSize + lane8 * kVec;
  float v[kVec];
  load16<D>(in, active ? i : 0, vec_in && active, active ? kVec : 0, v);
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m = fmaxf(m, ops::finite_abs(v[j]));
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!active) return;
  const uint16_t s16 = ops::int4_scale_f16(m);
  if (lane8 == 0) scale[g] = s16;
  const float s = f16_to_f32(s16);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) lo |= static_cast<uint32_t>(ops::quant_int4(v[j], s)) << (4 * j);
#pragma unroll
  for (int j = 0; j < 8; ++j) hi |= static_cast<uint32_t>(ops::quant_int4(v[8 + j], s)) << (4 * j);
  uint8_t* o = out + i / 2;
  if (vec_out) {
    *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
  } else {
    for (int j = 0; j < 4; ++j) o[j] = static_cast<uint8_t>(lo >> (8 * j));
    for (int j = 0; j < 4; ++j) o[4 + j] = static_cast<uint8_t>(hi >> (8 * j));
  }
}

// Dtype conversion, 16 elements per thread.
template <DType D, DType O>
__global__ void __launch_bounds__(kThreads) none_kernel(const void* in, void* out, int64_t n, bool vec) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (i >= n) return;
  const int cnt = static_cast<int>(imin(kVec, n - i));
  const bool full = vec && cnt == kVec;
  float v[kVec];
  load16<D>(in, i, full, cnt, v);
  if constexpr (O == DType::kF32) {
    float* o = static_cast<float*>(out) + i;
    if (full) {
#pragma unroll
      for (int j = 0; j < 4; ++j) reinterpret_cast<float4*>(o)[j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    } else {
      for (int j = 0; j < cnt; ++j) o[j] = v[j];
    }
  } else {
    uint16_t h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = O == DType::kBF16 ? ops::to_bf16(v[j]) : f32_to_f16(v[j]);
    uint16_t* o = static_cast<uint16_t*>(out) + i;
    if (full) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint4 u;
        u.x = h[8 * j + 0] | (static_cast<uint32_t>(h[8 * j + 1]) << 16);
        u.y = h[8 * j + 2] | (static_cast<uint32_t>(h[8 * j + 3]) << 16);
        u.z = h[8 * j + 4] | (static_cast<uint32_t>(h[8 * j + 5]) << 16);
        u.w = h[8 * j + 6] | (static_cast<uint32_t>(h[8 * j + 7]) << 16);
        reinterpret_cast<uint4*>(o)[j] = u;
      }
    } else {
      for (int j = 0; j < cnt; ++j) o[j] = h[j];
    }
  }
}

unsigned blocks_for(int64_t work, int64_t per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

template <DType D>
Status launch_none(const QuantArgs& a, cudaStream_t st) {
  const int64_t n = a.rows * a.cols;
  if (n == 0) return ok_status();  // an empty grid is a launch error
  if (a.out_dtype == D) {
    FERRY_CUDA_CHECK(cudaMemcpyAsync(a.out, a.in, dtype_bytes(D, n), cudaMemcpyDeviceToDevice, st));
    return ok_status();
  }
  const bool vec = aligned16(a.in) && aligned16(a.out);
  const unsigned blocks = blocks_for(n, int64_t{kThreads} * kVec);
  if (a.out_dtype == DType::kF32) {
    none_kernel<D, DType::kF32><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  } else if (a.out_dtype == DType::kBF16) {
    none_kernel<D, DType::kBF16><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  } else {
    none_kernel<D, DType::kF16><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  }
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status launch(const QuantArgs& a, cudaStream_t st) {
  const bool vec = a.cols % kVec == 0 && aligned16(a.in) && aligned16(a.out);
  float* scale = static_cast<float*>(a.scale);
  uint8_t* out = static_cast<uint8_t*>(a.out);
  // Grids are limited to 2^31 - 1 blocks in x: far beyond any weight's rows.
  switch (a.scheme) {
    case Scheme::kNone: return launch_none<D>(a, st);
    case Scheme::kFp8PerChannel:
      if (a.rows > 0) row_kernel<D, kFp8Channel><<<blocks_for(a.rows, 1), kThreads, 0, st>>>({a.in, out, scale, 0, a.cols, vec});
      break;
    case Scheme::kInt8PerChannel:
      if (a.rows > 0) row_kernel<D, kInt8Channel><<<blocks_for(a.rows, 1), kThreads, 0, st>>>({a.in, out, scale, 0, a.cols, vec});
      break;
    case Scheme::kFp8PerTensor: {
      const size_t shards = a.shard_begin.size() - 1;
      FERRY_CUDA_CHECK(cudaMemsetAsync(scale, 0, shards * sizeof(float), st));
      for (size_t s = 0; s < shards; ++s) {
        const int64_t r0 = a.shard_begin[s], n = a.shard_begin[s + 1] - r0;
        if (n > 0) row_kernel<D, kAmaxOnly><<<blocks_for(n, 1), kThreads, 0, st>>>({a.in, out, scale + s, r0, a.cols, vec});
      }
      FERRY_CUDA_LAUNCH_CHECK();
      finalize_fp8_scale<<<1, static_cast<unsigned>(kMaxShards), 0, st>>>(scale, static_cast<int>(shards));
      FERRY_CUDA_LAUNCH_CHECK();
      for (size_t s = 0; s < shards; ++s) {
        const int64_t r0 = a.shard_begin[s], n = a.shard_begin[s + 1] - r0;
        if (n > 0) row_kernel<D, kFp8Given><<<blocks_for(n, 1), kThreads, 0, st>>>({a.in, out, scale + s, r0, a.cols, vec});
      }
      break;
    }
    case Scheme::kFp8Block: {
      const dim3 grid(blocks_for(a.cols, kFp8BlockSize), blocks_for(a.rows, kFp8BlockSize));
      if (grid.x > 0 && grid.y > 0) block_kernel<D><<<grid, kThreads, 0, st>>>(a.in, out, scale, a.rows, a.cols, vec);
      break;
    }
    case Scheme::kInt4Group: {
      const int64_t groups = a.rows * (a.cols / kInt4GroupSize);
      const bool vec_in = aligned16(a.in);
      const bool vec_out = aligned8(a.out);
      if (groups > 0) {
        int4_kernel<D><<<blocks_for(groups * 8, kThreads), kThreads, 0, st>>>(
            a.in, out, static_cast<uint16_t*>(a.scale), groups, a.cols, vec_in, vec_out);
      }
      break;
    }
    case Scheme::kGptqInt4: return Status::invalid_argument("quantize: gptq_int4 is a quantized reload");
  }
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

}  // namespace

Status quantize(const QuantArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  switch (a.in_dtype) {
    case DType::kBF16: return launch<DType::kBF16>(a, st);
    case DType::kF16: return launch<DType::kF16>(a, st);
    default: return launch<DType::kF32>(a, st);
  }
}

}  // namespace ferry::kernels::detail::cuda

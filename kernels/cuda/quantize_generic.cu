// The generic CUDA quantize kernels: one block per row (per 128x128 tile), any alignment, rows of
// any length (values beyond what registers hold are read again, from L1/L2). The vectorized kernels
// of quantize_rows.cu and quantize.cu hand over to these when they cannot run (unaligned or very
// long rows), under any fp8 rule (QuantArgs::fp8; ferry's own rule is the default).
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/internal.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

inline constexpr int kCacheSegs = 2;  // 16-element segments a thread keeps in registers

struct RowParams {
  const void* in;
  void* out;
  float* scale;  // per-row scales, or the shard's scale/amax slot
  int64_t row0;  // first row handled (shards)
  int64_t cols;
  bool vec;  // input and output rows are 16-byte aligned and cols % 16 == 0
  ops::Fp8Rule fp8;
};

template <int kMode>
__device__ __forceinline__ uint8_t quant_byte(float x, float s, float inv, const ops::Fp8Rule& r) {
  if constexpr (kMode == kInt8Channel) {
    return static_cast<uint8_t>(ops::quant_int8(x, s));
  } else {
    return ops::quant_fp8(x, s, inv, r);
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
      scale = kMode == kInt8Channel ? ops::int8_scale(m) : ops::fp8_scale(m, p.fp8);
      if (threadIdx.x == 0) p.scale[r] = scale;
    }
    const float inv = ops::fp8_multiplier(scale, p.fp8);
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
      for (int j = 0; j < kVec; ++j) b[j] = quant_byte<kMode>(v[j], scale, inv, p.fp8);
      store16_bytes(out + c, p.vec, n, b);
    }
  }
}

__global__ void finalize_fp8_scale(float* scale, int n, ops::Fp8Rule rule) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) scale[i] = ops::fp8_scale(scale[i], rule);  // the slot holds amax until here
}

// One block per 128x128 tile; each thread keeps its 4 segments in registers.
// blockIdx.y counts the 128-row bands of all stacked matrices; bands restart at each matrix.
template <DType D>
__global__ void __launch_bounds__(kThreads) block_kernel(const void* in, uint8_t* out, float* scale, int64_t mrows,
                                                         int64_t cols, bool vec, ops::Fp8Rule rule) {
  constexpr int kSegsPerRow = kFp8BlockSize / kVec;                         // 8
  constexpr int kPerThread = kFp8BlockSize * kSegsPerRow / kThreads;        // 4
  const int64_t bands = (mrows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t mat = blockIdx.y / bands;
  const int64_t r0 = mat * mrows + (blockIdx.y % bands) * kFp8BlockSize;
  const int64_t rows = mat * mrows + mrows;  // rows of this matrix end here
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
  const float s = ops::fp8_scale(block_max(m), rule);
  const float inv = ops::fp8_multiplier(s, rule);
  if (threadIdx.x == 0) scale[blockIdx.y * gridDim.x + blockIdx.x] = s;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    uint8_t b[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = ops::quant_fp8(v[t][j], s, inv, rule);
    if (cnt[t] > 0) store16_bytes(out + at[t], vec && cnt[t] == kVec, cnt[t], b);
  }
}

unsigned blocks_for(int64_t work, int64_t per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

template <DType D>
Status rows_typed(const QuantArgs& a, cudaStream_t st) {
  const bool vec = a.cols % kVec == 0 && aligned16(a.in) && aligned16(a.out);
  float* scale = static_cast<float*>(a.scale);
  uint8_t* out = static_cast<uint8_t*>(a.out);
  // Grids are limited to 2^31 - 1 blocks in x: far beyond any weight's rows.
  if (a.rows == 0) return ok_status();
  if (a.scheme == Scheme::kInt8PerChannel) {
    row_kernel<D, kInt8Channel><<<blocks_for(a.rows, 1), kThreads, 0, st>>>({a.in, out, scale, 0, a.cols, vec, a.fp8});
  } else {
    row_kernel<D, kFp8Channel><<<blocks_for(a.rows, 1), kThreads, 0, st>>>({a.in, out, scale, 0, a.cols, vec, a.fp8});
  }
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status per_tensor_typed(const QuantArgs& a, cudaStream_t st) {
  const bool vec = a.cols % kVec == 0 && aligned16(a.in) && aligned16(a.out);
  float* scale = static_cast<float*>(a.scale);
  uint8_t* out = static_cast<uint8_t*>(a.out);
  const size_t shards = a.shard_begin.size() - 1;
  FERRY_CUDA_CHECK(cudaMemsetAsync(scale, 0, shards * sizeof(float), st));
  for (size_t s = 0; s < shards; ++s) {
    const int64_t r0 = a.shard_begin[s], n = a.shard_begin[s + 1] - r0;
    if (n > 0) {
      row_kernel<D, kAmaxOnly><<<blocks_for(n, 1), kThreads, 0, st>>>({a.in, out, scale + s, r0, a.cols, vec, a.fp8});
    }
  }
  FERRY_CUDA_LAUNCH_CHECK();
  finalize_fp8_scale<<<1, static_cast<unsigned>(kMaxShards), 0, st>>>(scale, static_cast<int>(shards), a.fp8);
  FERRY_CUDA_LAUNCH_CHECK();
  for (size_t s = 0; s < shards; ++s) {
    const int64_t r0 = a.shard_begin[s], n = a.shard_begin[s + 1] - r0;
    if (n > 0) {
      row_kernel<D, kFp8Given><<<blocks_for(n, 1), kThreads, 0, st>>>({a.in, out, scale + s, r0, a.cols, vec, a.fp8});
    }
  }
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status block_typed(const QuantArgs& a, cudaStream_t st) {
  const bool vec = a.cols % kVec == 0 && aligned16(a.in) && aligned16(a.out);
  const int64_t batch = a.matrix_rows > 0 ? a.rows / a.matrix_rows : 0;
  const int64_t bands = batch * ((a.matrix_rows + kFp8BlockSize - 1) / kFp8BlockSize);
  if (bands > 65535) {  // a grid's y
    return Status::invalid_argument("quantize fp8_block (unaligned input): " + std::to_string(bands) +
                                    " bands of 128 rows, more than a grid holds; align the input to 16 bytes");
  }
  const dim3 grid(blocks_for(a.cols, kFp8BlockSize), static_cast<unsigned>(bands));
  if (grid.x > 0 && grid.y > 0) {
    block_kernel<D><<<grid, kThreads, 0, st>>>(a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale),
                                               a.matrix_rows, a.cols, vec, a.fp8);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  return ok_status();
}

}  // namespace

Status generic_rows(const QuantArgs& a, cudaStream_t st) {
  return by_float_dtype(a.in_dtype, [&](auto d) { return rows_typed<decltype(d)::value>(a, st); });
}
Status generic_per_tensor(const QuantArgs& a, cudaStream_t st) {
  return by_float_dtype(a.in_dtype, [&](auto d) { return per_tensor_typed<decltype(d)::value>(a, st); });
}
Status generic_block(const QuantArgs& a, cudaStream_t st) {
  return by_float_dtype(a.in_dtype, [&](auto d) { return block_typed<decltype(d)::value>(a, st); });
}

}  // namespace ferry::kernels::detail::cuda

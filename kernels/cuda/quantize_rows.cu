// CUDA row-scaled quantize kernels: fp8_per_channel and int8_per_channel (one pass: each row's raw
// 16-byte vectors stay in registers between the amax and the encode) and fp8_per_tensor's two-kernel
// path (amax, then encode).
//
// Why they are shaped this way (memory speed on H100/H200 needs ~40 KB in flight per SM):
//  - every thread issues all of its row's loads before it uses any (kVecs 16-byte loads in flight
//    per thread), and keeps them raw (bf16 pairs) so that registers allow high occupancy;
//  - a group of `tpr` threads (a power of two, 32..256) owns a row, so short rows do not leave most
//    of a block idle, and the row max is a warp shuffle plus one shared-memory step;
//  - one block per group of rows (no persistent loop): short-lived blocks overlap one block's
//    barrier with another's loads, which a persistent grid of few resident blocks could not (0.46 of
//    the copy bandwidth persistent, on the H200); inputs are read with evict-first hints and codes
//    written with streaming stores;
//  - fp8_per_tensor, shards at least as large as the device's L2 on sm_90 and later: one
//    cooperative kernel per shard (quantize_tensor.cu). Smaller shards and older devices: two
//    kernels, amax then encode, the encode in reverse order of the amax pass so that the tail of
//    the input may still be in L2.
//    Each runs near memory speed on the H200 (0.98 and 0.92 of the device copy), so the pair
//    reaches 0.55 of it: the input is read twice.
// Rows longer than 256 threads x 8 vectors, and unaligned rows, take the generic kernels in
// quantize_generic.cu.
#include <limits>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fast_quant.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/internal.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

struct RowsParams {
  const void* in;
  uint8_t* out;
  float* scale;
  int64_t rows;
  int64_t cols;
  int tpr;  // threads per row: 32, 64, 128 or 256
  ops::Fp8Rule fp8;  // ferry's or an engine layout's fp8 arithmetic
};

// One group of rows per block (the grid covers every row): registers stay few enough for six
// blocks of bf16 rows per SM (40 registers; 48, so five blocks, with a grid-stride loop: 0.75 of the
// device copy against 0.85, bench/gpu/quant_probe.cu).
template <DType D, int kMode, int kVecs>
__global__ void __launch_bounds__(kThreads, (D == DType::kBF16 && kVecs == 4) ? 6 : 1) rows_kernel(RowsParams p) {
  constexpr int E = kPerVec<D>;
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  __shared__ float warp_amax[kThreads / 32];
  const int tpr = p.tpr;
  const int g = static_cast<int>(threadIdx.x) / tpr, lane = static_cast<int>(threadIdx.x) % tpr;
  const int nv = static_cast<int>(p.cols / E);  // at most kThreads * 8 (rows_typed)
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / tpr) + g;
  const bool live = r < p.rows;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.in) + (live ? r : 0) * p.cols * kSize);
  uint4 raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = j * tpr + lane;
    raw[j] = live && v < nv ? __ldcs(src + v) : make_uint4(0, 0, 0, 0);
  }
  float m = warp_max(vec_amax<D>(raw));
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = m;
  __syncthreads();
  const int w0 = g * (tpr >> 5);
  for (int w = 0; w < (tpr >> 5); ++w) m = fmaxf(m, warp_amax[w0 + w]);
  if (!live) return;
  const float s = kMode == kInt8Channel ? ops::int8_scale(m) : ops::fp8_scale(m, p.fp8);
  [[maybe_unused]] const float rs = fast_recip(s);  // int8
  [[maybe_unused]] const float inv = ops::fp8_multiplier(s, p.fp8);  // kFp8Rule
  if (lane == 0) p.scale[r] = s;
  uint8_t* dst = p.out + r * p.cols;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = j * tpr + lane;
    if (v >= nv) continue;
    float f[E];
    unpack<D>(raw[j], f);
    uint8_t b[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if constexpr (kMode == kFp8Channel) {
        b[e] = ops::quant_fp8(f[e], s);
      } else if constexpr (kMode == kFp8Rule) {
        b[e] = ops::quant_fp8(f[e], s, inv, p.fp8);
      } else {
        b[e] = static_cast<uint8_t>(static_cast<int8_t>(quant_int_fast(f[e], s, rs, -127.0f, 127.0f)));
      }
    }
    store_codes<E>(dst + static_cast<int64_t>(v) * E, b);
  }
}

// Flat element ranges of the shards of one tensor (fp8_per_tensor), one shard per blockIdx.y.
struct ShardParams {
  const void* in;
  uint8_t* out;
  float* slot;  // amax slots during pass 1, the shards' scales in pass 2
  int64_t begin[kMaxShards + 1];
  ops::Fp8Rule fp8;
};

inline constexpr int kUnroll = 4;  // vectors per thread per step of the flat kernels

template <DType D>
__global__ void __launch_bounds__(kThreads) shard_amax_kernel(ShardParams p) {
  constexpr int E = kPerVec<D>;
  const int s = blockIdx.y;
  const int64_t v0 = p.begin[s] / E, v1 = p.begin[s + 1] / E;
  const uint4* src = static_cast<const uint4*>(p.in);
  float m = 0.0f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
  for (int64_t v = v0 + static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; v < v1; v += step) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = v + j * kThreads;
      raw[j] = i < v1 ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
    }
    m = fmaxf(m, vec_amax<D>(raw));
  }
  m = block_max(m);
  // Non-negative floats order like their bits, so the integer max is the float max.
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(p.slot + s), __float_as_uint(m));
}

// Chunks of kThreads * kUnroll vectors, walked from the end of the shard (see the file comment).
// kRule: by an engine layout's rule (ShardParams::fp8), else by ferry's.
template <DType D, bool kRule>
__global__ void __launch_bounds__(kThreads) shard_encode_kernel(ShardParams p) {
  constexpr int E = kPerVec<D>;
  constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;
  const int s = blockIdx.y;
  const int64_t v0 = p.begin[s] / E, v1 = p.begin[s + 1] / E;
  const int64_t chunks = (v1 - v0 + kChunk - 1) / kChunk;
  const float scale = p.slot[s];
  [[maybe_unused]] const float inv = ops::fp8_multiplier(scale, p.fp8);
  const uint4* src = static_cast<const uint4*>(p.in);
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t first = v0 + (chunks - 1 - c) * kChunk + threadIdx.x;
    uint4 raw[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = first + j * kThreads;
      raw[j] = i < v1 ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = first + j * kThreads;
      if (i >= v1) continue;
      float f[E];
      unpack<D>(raw[j], f);
      uint8_t b[E];
#pragma unroll
      for (int e = 0; e < E; ++e) b[e] = kRule ? ops::quant_fp8(f[e], scale, inv, p.fp8) : ops::quant_fp8(f[e], scale);
      store_codes<E>(p.out + i * E, b);
    }
  }
}

__global__ void finalize_fp8_scale(float* scale, int n, ops::Fp8Rule rule) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) scale[i] = ops::fp8_scale(scale[i], rule);  // the slot holds amax until here
}

template <DType D, int kMode, int kVecs>
Status launch_rows(const QuantArgs& a, int tpr, cudaStream_t st) {
  const RowsParams p{a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale), a.rows, a.cols, tpr, a.fp8};
  const auto kernel = rows_kernel<D, kMode, kVecs>;
  // One group of rows per block: short-lived blocks keep the memory system busier than a persistent
  // grid whose blocks alternate between loading and a barrier (measured on the H200).
  const int64_t blocks = (a.rows * tpr + kThreads - 1) / kThreads;
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return Status::invalid_argument("quantize: " + std::to_string(a.rows) + " rows exceed one launch");
  }
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(p);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D, int kMode>
Status rows_typed(const QuantArgs& a, cudaStream_t st) {
  constexpr int E = kPerVec<D>;
  const bool vec = aligned16(a.in) && (a.cols * (D == DType::kF32 ? 4 : 2)) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.out) % E == 0;
  const int64_t nv = a.cols / E;
  if (!vec || nv > int64_t{kThreads} * 8) return generic_rows(a, st);
  if (a.rows == 0) return ok_status();
  if (nv <= int64_t{kThreads} * 4) {
    int tpr = 32;
    while (int64_t{tpr} * 4 < nv) tpr *= 2;
    return launch_rows<D, kMode, 4>(a, tpr, st);
  }
  return launch_rows<D, kMode, 8>(a, kThreads, st);
}

template <DType D>
Status per_tensor_typed(const QuantArgs& a, cudaStream_t st) {
  constexpr int E = kPerVec<D>;
  const size_t shards = a.shard_begin.size() - 1;
  bool vec = aligned16(a.in) && reinterpret_cast<uintptr_t>(a.out) % E == 0;
  ShardParams p{a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale), {}, a.fp8};
  for (size_t s = 0; s <= shards; ++s) {
    p.begin[s] = a.shard_begin[s] * a.cols;
    vec = vec && p.begin[s] % E == 0;
  }
  if (!vec) return generic_per_tensor(a, st);
  cudaError_t error = cudaSuccess;
  // The one-kernel path encodes by ferry's rule only; an engine layout's takes the two kernels.
  switch (a.fp8.is_ferry() ? quantize_per_tensor_fused(a, p.begin, shards, st, &error) : FusedResult::kNotUsed) {
    case FusedResult::kUsed: return ok_status();
    case FusedResult::kFailed: FERRY_CUDA_CHECK(error); return Status::internal("fp8_per_tensor: launch failed");
    case FusedResult::kNotUsed: break;
  }
  const int64_t total = a.rows * a.cols;
  FERRY_CUDA_CHECK(cudaMemsetAsync(a.scale, 0, shards * sizeof(float), st));
  if (total > 0) {
    const int64_t per_block = int64_t{kThreads} * kUnroll * E;
    const auto amax = shard_amax_kernel<D>;
    const unsigned x = std::max<unsigned>(
        1, persistent_blocks(reinterpret_cast<const void*>(amax), (total + per_block - 1) / per_block) /
               static_cast<unsigned>(shards));
    amax<<<dim3(x, static_cast<unsigned>(shards)), kThreads, 0, st>>>(p);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  finalize_fp8_scale<<<1, static_cast<unsigned>(kMaxShards), 0, st>>>(p.slot, static_cast<int>(shards), a.fp8);
  FERRY_CUDA_LAUNCH_CHECK();
  if (total > 0) {
    const int64_t per_block = int64_t{kThreads} * kUnroll * E;
    const auto encode_k = a.fp8.is_ferry() ? shard_encode_kernel<D, false> : shard_encode_kernel<D, true>;
    int64_t most = 0;  // chunks of the largest shard: one block each
    for (size_t s = 0; s < shards; ++s) most = std::max(most, p.begin[s + 1] - p.begin[s]);
    const unsigned x = static_cast<unsigned>(std::clamp<int64_t>((most + per_block - 1) / per_block, 1, 65535));
    encode_k<<<dim3(x, static_cast<unsigned>(shards)), kThreads, 0, st>>>(p);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  return ok_status();
}

}  // namespace

Status quantize_per_channel(const QuantArgs& a, bool int8, cudaStream_t st) {
  return by_float_dtype(a.in_dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    if (int8) return rows_typed<D, kInt8Channel>(a, st);
    // kFp8Channel takes the rule's scale; a rule that also encodes otherwise takes kFp8Rule.
    return a.fp8.encodes_as_ferry() ? rows_typed<D, kFp8Channel>(a, st) : rows_typed<D, kFp8Rule>(a, st);
  });
}

Status quantize_per_tensor(const QuantArgs& a, cudaStream_t st) {
  return by_float_dtype(a.in_dtype, [&](auto d) { return per_tensor_typed<decltype(d)::value>(a, st); });
}

}  // namespace ferry::kernels::detail::cuda

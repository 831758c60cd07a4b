// CUDA row-scaled quantize kernels: fp8_per_channel and int8_per_channel (one pass: each row's raw
// 16-byte vectors stay in registers between the amax and the encode) and fp8_per_tensor (two
// passes: amax, then encode).
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
//  - fp8_per_tensor runs as one cooperative kernel where the GPU allows it (per_tensor_coop_kernel):
//    every block owns a contiguous range of a shard and keeps the end of it in shared memory and, with
//    an evict-last policy, the part before that in L2; after a grid-wide barrier it encodes those
//    parts first, so only the rest of the input is read from HBM twice. Otherwise two kernels:
//    amax, then encode in reverse order of the amax pass, so the tail still in L2 is read from it.
// Rows longer than 256 threads x 8 vectors, and unaligned rows, take the generic kernels in
// quantize_generic.cu.
#include <cooperative_groups.h>

#include <limits>
#include <mutex>
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
  const float s = kMode == kInt8Channel ? ops::int8_scale(m) : ops::fp8_scale(m);
  [[maybe_unused]] const float rs = fast_recip(s);  // int8
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
template <DType D>
__global__ void __launch_bounds__(kThreads) shard_encode_kernel(ShardParams p) {
  constexpr int E = kPerVec<D>;
  constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;
  const int s = blockIdx.y;
  const int64_t v0 = p.begin[s] / E, v1 = p.begin[s + 1] / E;
  const int64_t chunks = (v1 - v0 + kChunk - 1) / kChunk;
  const float scale = p.slot[s];
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
      for (int e = 0; e < E; ++e) b[e] = ops::quant_fp8(f[e], scale);
      store_codes<E>(p.out + i * E, b);
    }
  }
}

// One cooperative kernel for fp8_per_tensor (see the file comment). Block b of shard s owns vectors
// [lo, hi) of the shard: [lo, keep) streams (read twice from HBM), [keep, held) is read with an L2
// evict-last policy in the first phase, [held, hi) is kept in shared memory. `scale` collects each
// shard's amax (as float bits) until both barriers have passed, then holds its scale.
inline constexpr int kCoopThreads = 1024;
std::mutex g_options_mu;
PerTensorOptions g_options;
inline constexpr int kCoopUnroll = 4;

struct CoopParams {
  const void* in;
  uint8_t* out;
  float* scale;
  int64_t vbegin[kMaxShards + 1];  // shard boundaries, in 16-byte vectors
  int block_first[kMaxShards + 1];  // shard s has blocks [block_first[s], block_first[s + 1])
  int64_t hold;                     // vectors a block keeps in shared memory
  int64_t keep;                     // vectors a block asks L2 to keep
};

__device__ __forceinline__ uint4 load_evict_last(const uint4* p, uint64_t policy) {
  uint4 u;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p), "l"(policy));
  return u;
}

template <DType D>
__device__ __forceinline__ void encode_vec(const uint4& raw, float s, uint8_t* dst) {
  constexpr int E = kPerVec<D>;
  float f[E];
  unpack<D>(raw, f);
  uint8_t b[E];
#pragma unroll
  for (int e = 0; e < E; ++e) b[e] = ops::quant_fp8(f[e], s);
  store_codes<E>(dst, b);
}

template <DType D>
__global__ void __launch_bounds__(kCoopThreads, 1) per_tensor_coop_kernel(CoopParams p) {
  constexpr int E = kPerVec<D>;
  extern __shared__ uint4 held_vecs[];
  int s = 0;
  while (static_cast<int>(blockIdx.x) >= p.block_first[s + 1]) ++s;
  const int64_t nb = p.block_first[s + 1] - p.block_first[s], b = blockIdx.x - p.block_first[s];
  const int64_t v0 = p.vbegin[s], len = p.vbegin[s + 1] - v0;
  const int64_t lo = v0 + len * b / nb, hi = v0 + len * (b + 1) / nb;
  const int64_t held = hi - lo > p.hold ? hi - p.hold : lo;
  const int64_t keep = held - lo > p.keep ? held - p.keep : lo;
  const uint4* src = static_cast<const uint4*>(p.in);
  constexpr int64_t kStep = int64_t{kCoopThreads} * kCoopUnroll;
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));

  // Phase 1: the shard's amax.
  float m = 0.0f;
  for (int64_t v = lo + threadIdx.x; v < keep; v += kStep) {
    uint4 raw[kCoopUnroll];
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      raw[j] = i < keep ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
    }
    m = fmaxf(m, vec_amax<D>(raw));
  }
  for (int64_t v = keep + threadIdx.x; v < held; v += kStep) {
    uint4 raw[kCoopUnroll];
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      raw[j] = i < held ? load_evict_last(src + i, policy) : make_uint4(0, 0, 0, 0);
    }
    m = fmaxf(m, vec_amax<D>(raw));
  }
  for (int64_t v = held + threadIdx.x; v < hi; v += kStep) {
    uint4 raw[kCoopUnroll];
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      raw[j] = i < hi ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      if (i < hi) held_vecs[i - held] = raw[j];  // read back by this same thread in phase 2
    }
    m = fmaxf(m, vec_amax<D>(raw));
  }
  m = block_max(m);
  // Non-negative floats order like their bits, so the integer max is the float max.
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(p.scale + s), __float_as_uint(m));
  auto grid = cooperative_groups::this_grid();
  grid.sync();
  const float sc = ops::fp8_scale(__uint_as_float(*reinterpret_cast<volatile unsigned int*>(p.scale + s)));
  grid.sync();  // every block has read the amax: the shard's first block may overwrite it
  if (b == 0 && threadIdx.x == 0) p.scale[s] = sc;

  // Phase 2: encode what L2 was asked to keep, then what shared memory holds, then the rest.
  for (int64_t v = keep + threadIdx.x; v < held; v += kStep) {
    uint4 raw[kCoopUnroll];
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      raw[j] = i < held ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      if (i < held) encode_vec<D>(raw[j], sc, p.out + i * E);
    }
  }
  for (int64_t i = held + threadIdx.x; i < hi; i += kCoopThreads) encode_vec<D>(held_vecs[i - held], sc, p.out + i * E);
  for (int64_t v = lo + threadIdx.x; v < keep; v += kStep) {
    uint4 raw[kCoopUnroll];
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      raw[j] = i < keep ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kCoopUnroll; ++j) {
      const int64_t i = v + j * kCoopThreads;
      if (i < keep) encode_vec<D>(raw[j], sc, p.out + i * E);
    }
  }
}

// Launches per_tensor_coop_kernel when this GPU runs cooperative kernels with one block of it per
// SM; `launched` false (and OK) otherwise, for the two-kernel path.
template <DType D>
Status launch_coop(const ShardParams& sp, size_t shards, cudaStream_t st, bool* launched) {
  *launched = false;
  struct Setup {
    bool ok = false;
    int blocks = 0;
    size_t smem = 0;
    int64_t keep_bytes = 0;  // L2's size
  };
  static Setup per_device[64];
  static std::once_flag once[64];
  int dev = 0;
  FERRY_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return ok_status();
  std::call_once(once[dev], [dev] {
    Setup& su = per_device[dev];
    int coop = 0, sms = 0, smem_optin = 0, l2 = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    // Shared memory for the held vectors, less what the block's own reductions use.
    const size_t smem = static_cast<size_t>(std::max(0, smem_optin - 4096)) & ~size_t{15};
    const auto kernel = per_tensor_coop_kernel<D>;
    if (!coop || smem < 16 ||
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCoopThreads, smem) != cudaSuccess || per_sm < 1) {
      (void)cudaGetLastError();
      return;
    }
    su.ok = true;
    su.blocks = sms;  // one block per SM: all resident at once, as a grid barrier needs
    su.smem = smem;
    su.keep_bytes = l2;
  });
  const Setup& su = per_device[dev];
  if (!su.ok || static_cast<size_t>(su.blocks) < shards) return ok_status();
  constexpr int E = kPerVec<D>;
  CoopParams p{sp.in, sp.out, sp.slot, {}, {}, 0, 0};
  int64_t total = 0;
  for (size_t s = 0; s <= shards; ++s) p.vbegin[s] = sp.begin[s] / E;
  total = p.vbegin[shards] - p.vbegin[0];
  if (total <= 0) return ok_status();
  // Blocks to shards in proportion to their vectors, at least one each.
  int given = 0;
  p.block_first[0] = 0;
  for (size_t s = 0; s < shards; ++s) {
    const int64_t len = p.vbegin[s + 1] - p.vbegin[s];
    const int left = su.blocks - given - static_cast<int>(shards - s - 1);
    int nb = s + 1 == shards ? left : static_cast<int>(std::max<int64_t>(1, len * su.blocks / total));
    nb = std::max(1, std::min(nb, left));
    given += nb;
    p.block_first[s + 1] = given;
  }
  const PerTensorOptions o = per_tensor_options();
  p.hold = o.hold ? static_cast<int64_t>(su.smem / 16) : 0;
  p.keep = su.keep_bytes * std::clamp(o.l2_keep_percent, 0, 100) / 100 / 16 / given;
  void* args[] = {&p};
  FERRY_CUDA_CHECK(cudaMemsetAsync(sp.slot, 0, shards * sizeof(float), st));
  FERRY_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(per_tensor_coop_kernel<D>),
                                               dim3(static_cast<unsigned>(given)), dim3(kCoopThreads), args, su.smem, st));
  *launched = true;
  return ok_status();
}

__global__ void finalize_fp8_scale(float* scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) scale[i] = ops::fp8_scale(scale[i]);  // the slot holds amax until here
}

template <DType D, int kMode, int kVecs>
Status launch_rows(const QuantArgs& a, int tpr, cudaStream_t st) {
  const RowsParams p{a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale), a.rows, a.cols, tpr};
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
  ShardParams p{a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale), {}};
  for (size_t s = 0; s <= shards; ++s) {
    p.begin[s] = a.shard_begin[s] * a.cols;
    vec = vec && p.begin[s] % E == 0;
  }
  if (!vec) return generic_per_tensor(a, st);
  const int64_t total = a.rows * a.cols;
  if (total > 0 && per_tensor_options().cooperative) {
    bool launched = false;
    FERRY_RETURN_IF_ERROR(launch_coop<D>(p, shards, st, &launched));
    if (launched) return ok_status();
  }
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
  finalize_fp8_scale<<<1, static_cast<unsigned>(kMaxShards), 0, st>>>(p.slot, static_cast<int>(shards));
  FERRY_CUDA_LAUNCH_CHECK();
  if (total > 0) {
    const int64_t per_block = int64_t{kThreads} * kUnroll * E;
    const auto encode_k = shard_encode_kernel<D>;
    int64_t most = 0;  // chunks of the largest shard: one block each
    for (size_t s = 0; s < shards; ++s) most = std::max(most, p.begin[s + 1] - p.begin[s]);
    const unsigned x = static_cast<unsigned>(std::clamp<int64_t>((most + per_block - 1) / per_block, 1, 65535));
    encode_k<<<dim3(x, static_cast<unsigned>(shards)), kThreads, 0, st>>>(p);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  return ok_status();
}

template <typename Fn>
Status by_dtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::kBF16: return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16: return fn(std::integral_constant<DType, DType::kF16>{});
    default: return fn(std::integral_constant<DType, DType::kF32>{});
  }
}

}  // namespace

Status quantize_per_channel(const QuantArgs& a, bool int8, cudaStream_t st) {
  return by_dtype(a.in_dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    return int8 ? rows_typed<D, kInt8Channel>(a, st) : rows_typed<D, kFp8Channel>(a, st);
  });
}

void set_per_tensor_options(const PerTensorOptions& options) {
  std::lock_guard<std::mutex> lock(g_options_mu);
  g_options = options;
}

PerTensorOptions per_tensor_options() {
  std::lock_guard<std::mutex> lock(g_options_mu);
  return g_options;
}

Status quantize_per_tensor(const QuantArgs& a, cudaStream_t st) {
  return by_dtype(a.in_dtype, [&](auto d) { return per_tensor_typed<decltype(d)::value>(a, st); });
}

}  // namespace ferry::kernels::detail::cuda

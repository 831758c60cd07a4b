// fp8_per_tensor in one cooperative kernel per shard (sm_90 and later): the input is read from HBM
// once and a half times, not twice.
//
// One block per SM owns an equal share of the shard's 32 KiB chunks (dealt in whole rounds over the
// grid, the remainder split evenly). Its last kHeldChunks chunks are read straight into registers
// (17 MB over the H200's SMs); the rest streams through a ring of shared memory slots with bulk
// copies (TMA), many bytes in flight per SM without registers. Pass 1 takes the amax; the last
// kStages chunks of the ring stay in shared memory (30 MB), and the kL2Chunks before them are loaded
// with an L2 evict_last policy. After a grid barrier, pass 2 encodes the chunks in registers and
// shared memory first, then the rest of the block's chunks from its last back to its first, so the
// chunks read last in pass 1 (the likeliest still in L2) are read first; the ones that come from
// HBM are prefetched into L2 a chunk ahead of their bulk copies (the first during the barrier).
//
// The encode divides the way the hardware division's fast path does (y: the scale's reciprocal
// refined once; per element q = x*y, r = x - s*q exactly, q' = q + r*y), without that path's
// per-element range test and branch, which cost this kernel its memory speed (bench/gpu/quant_probe.cu,
// H200: encode pass 57 us with the division, 39 us with this, 38 us writing constants). The test
// passes for every x when s lies in [2^-60, 2^60] and no element is inf or NaN: quotients below
// 2^-12 may come out inexact, but they are signed zeros in e4m3 either way (copysign mends -0, for
// which q' is +0). Otherwise (pass 1 flags any inf or NaN; the scale is checked) every element
// takes ops::quant_fp8. With an inf or NaN present the amax is also taken again, from HBM, in
// floats (finite_abs), since the integer max of pass 1 cannot leave them out.
//
// Workspace (per device, 32 bytes, zero between launches; the launches of one device are ordered
// by an event): [0] grid-barrier arrivals, [1] blocks done, [2] amax bits, [3] inf/NaN seen,
// [4] amax bits of the float recount. The last block out zeroes it.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <atomic>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fast_quant.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/internal.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

constexpr int kFThreads = 512;
constexpr int kStages = 7;
constexpr int kChunkVecs = 2048;  // 32 KiB
// Chunks before the ones kept in shared memory that pass 1 loads with L2 evict_last, and how far
// ahead of pass 2's bulk copies the chunks after them are prefetched into L2 (evict_last too). H200,
// ratio to the device copy: no prefetch, window 4 to 16: 0.61 to 0.63; prefetch 1 or 2, window 6 to
// 12: 0.648 to 0.658 (a contiguous range per block), 0.660 to 0.672 (whole rounds); prefetch 3 or 4:
// 0.625 to 0.641; prefetched with evict_normal: 0.633 to 0.636.
constexpr int kL2Chunks = 9;
constexpr int kPrefetch = 1;
// Read into registers (64 per thread): 0.633 of the device copy against 0.617 without, on the H200.
constexpr int kHeldChunks = 4;
constexpr size_t kRingBytes = size_t{kStages} * kChunkVecs * 16;
// Shards smaller than the device's L2 (or than this) take the two-kernel path: their second pass
// reads L2 anyway, and their two kernels overlap a rank's other process streams, where a cooperative
// kernel holds every SM. Colocated 8B update, fp8_per_tensor (H200, 50 MiB L2), one kernel for
// shards of at least 4 MiB: 11.10 and 11.33 ms; 32 MiB: 11.60; 64 MiB (only the MLP's 112 MiB
// shards): 10.35 and 10.41; never: 10.94 and 11.04.
constexpr int64_t kFusedMinBytes = int64_t{4} << 20;

struct TensorParams {
  const uint4* in;  // the shard's first vector
  uint8_t* out;     // the shard's first code
  float* scale;     // the shard's scale
  int64_t nv;       // 16-byte vectors in the shard
  uint32_t* ws;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The block's max of v, in thread 0.
__device__ __forceinline__ float fused_block_max(float v, float* part) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kFThreads / 32; ++w) v = fmaxf(v, part[w]);
  }
  return v;
}

// The codes of one vector: kFast as the file comment says, else ops::quant_fp8 per element.
template <DType D, bool kFast>
__device__ __forceinline__ void encode_vec(const uint4& raw, float s, float y, uint8_t* dst) {
  if constexpr (kFast) {
    fp8_encode_fast<D, false>(raw, s, y, dst);
  } else {
    constexpr int E = kPerVec<D>;
    float f[E];
    unpack<D>(raw, f);
    uint8_t b[E];
#pragma unroll
    for (int e = 0; e < E; ++e) b[e] = ops::quant_fp8(f[e], s);
    store_codes<E>(dst, b);
  }
}

#endif

template <DType D>
__global__ void __launch_bounds__(kFThreads, 1) tensor_kernel(TensorParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = kPerVec<D>;
  constexpr int kPer = kChunkVecs / kFThreads;  // vectors per thread per chunk
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ uint64_t bars[kStages];
  __shared__ float part[kFThreads / 32];
  __shared__ float s_scale;
  __shared__ uint32_t s_nonfinite;
  // The block's chunks. Chunk c < full is the shard's chunk c * G + b: whole rounds over the grid,
  // so that the SMs read neighbouring addresses at the same time (0.665 to 0.672 of the device copy
  // against 0.656 to 0.659 with a contiguous range per block, H200). The vectors after the whole
  // rounds are split evenly, on 1 KiB, into one shorter last chunk per block (or none): whole
  // chunks dealt round-robin would leave some blocks a chunk more than others at both barriers.
  // The split points round up, so that no piece exceeds a chunk (rest < G chunks; rounding down
  // would leave the last block up to 63 vectors more).
  const int64_t G = gridDim.x, b = blockIdx.x;
  const int64_t full = p.nv / (G * kChunkVecs);
  const int64_t tail = full * G * kChunkVecs, rest = p.nv - tail;
  auto split = [&](int64_t k) { return tail + imin(rest, ((rest * k / G) + 63) & ~int64_t{63}); };
  const int64_t t0 = split(b), t1 = split(b + 1);
  const int64_t all = full + (t1 > t0 ? 1 : 0);
  auto base = [&](int64_t c) { return c < full ? (c * G + b) * kChunkVecs : t0; };
  auto vecs = [&](int64_t c) { return static_cast<int>(c < full ? kChunkVecs : t1 - t0); };
  const int held = static_cast<int>(imin(kHeldChunks, all));
  const int64_t m = all - held;
  if (threadIdx.x == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(&bars[k]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int64_t c, uint64_t policy) {
    const int k = static_cast<int>(c % kStages);
    bulk_load(ring + int64_t{k} * kChunkVecs, p.in + base(c), static_cast<uint32_t>(vecs(c)) * 16u,
              &bars[k], policy);
  };
  const uint64_t first = l2_evict_first(), last = l2_evict_last();
  auto pass1_policy = [&](int64_t c) { return c < m - kStages && c >= m - kStages - kL2Chunks ? last : first; };
  // Pass 2 reads chunks m - kStages - kL2Chunks - 1 down to 0 from HBM; each is asked into L2 (and
  // kept there) kPrefetch chunks before its bulk copy is issued, the first ones before the barrier.
  auto prefetch = [&](int64_t c) {
    if (c >= 0) l2_prefetch(p.in + base(c), static_cast<uint32_t>(vecs(c)) * 16u, last);
  };
  uint32_t parity = 0;  // bit k: the phase slot k waits for next

  // Pass 1: the amax.
  if (threadIdx.x == 0) {
    for (int64_t c = 0; c < m && c < kStages; ++c) issue(c, pass1_policy(c));
  }
  uint4 reg[kHeldChunks][kPer];
#pragma unroll
  for (int h = 0; h < kHeldChunks; ++h) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = j * kFThreads + static_cast<int>(threadIdx.x);
      reg[h][j] = h < held && i < vecs(m + h) ? __ldcs(p.in + base(m + h) + i) : make_uint4(0, 0, 0, 0);
    }
  }
  uint32_t acc = 0;
  for (int64_t c = 0; c < m; ++c) {
    const int k = static_cast<int>(c % kStages);
    mbar_wait(&bars[k], (parity >> k) & 1u);
    parity ^= 1u << k;
    const uint4* src = ring + int64_t{k} * kChunkVecs;
    const int n = vecs(c);
    for (int i = threadIdx.x; i < n; i += kFThreads) acc = magnitude_max<D>(acc, src[i]);
    if (c + kStages < m) {
      __syncthreads();  // every thread is done with slot k
      if (threadIdx.x == 0) {
        fence_proxy_async();
        issue(c + kStages, pass1_policy(c + kStages));
      }
    }
  }
  if (threadIdx.x == 0) {
    for (int j = 0; j < kPrefetch; ++j) prefetch(m - kStages - kL2Chunks - 1 - j);
  }
#pragma unroll
  for (int h = 0; h < kHeldChunks; ++h) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc = magnitude_max<D>(acc, reg[h][j]);  // zeros where nothing was read
  }
  bool nonfinite = false;
  float mx = magnitude_value<D>(acc, nonfinite);
  const bool block_nonfinite = __syncthreads_or(nonfinite);
  mx = fused_block_max(nonfinite ? 0.0f : mx, part);
  if (threadIdx.x == 0) {
    atomicMax(p.ws + 2, __float_as_uint(mx));
    if (block_nonfinite) atomicOr(p.ws + 3, 1u);
  }
  grid_barrier(p.ws, 1);
  if (threadIdx.x == 0) s_nonfinite = load_acquire(p.ws + 3);
  __syncthreads();
  int amax_word = 2;
  if (s_nonfinite != 0) {
    // The amax again, in floats, leaving inf and NaN out (finite_abs).
    float f_max = 0.0f;
    for (int64_t v = blockIdx.x * int64_t{kFThreads} + threadIdx.x; v < p.nv; v += int64_t{gridDim.x} * kFThreads) {
      float f[E];
      unpack<D>(__ldg(p.in + v), f);
#pragma unroll
      for (int e = 0; e < E; ++e) f_max = fmaxf(f_max, ops::finite_abs(f[e]));
    }
    f_max = fused_block_max(f_max, part);
    if (threadIdx.x == 0) atomicMax(p.ws + 4, __float_as_uint(f_max));
    grid_barrier(p.ws, 2);
    amax_word = 4;
  }
  if (threadIdx.x == 0) {
    s_scale = ops::fp8_scale(__uint_as_float(load_acquire(p.ws + amax_word)));
    if (blockIdx.x == 0) *p.scale = s_scale;
  }
  __syncthreads();
  const float s = s_scale;
  const float y = s_nonfinite == 0 ? fp8_fast_multiplier(s, 0.0f, ops::Fp8Rule{}) : 0.0f;
  const bool fast = y != 0.0f;
  uint8_t* out = p.out;
  // Pass 2: the chunks held in registers, then chunks m-1 down to 0, chunk c in slot c % kStages
  // (the last kStages of them already are). One copy of the loops per division, no branch in them.
  // (Encoding the registers' chunks after the shared-memory ones, while their slots load again,
  // measured 121 us against 79 on the H200: the registers' live range then spans the loop.)
  auto pass2 = [&](auto fast_v) {
    constexpr bool kFast = decltype(fast_v)::value;
#pragma unroll
    for (int h = 0; h < kHeldChunks; ++h) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = j * kFThreads + static_cast<int>(threadIdx.x);
        if (h < held && i < vecs(m + h)) encode_vec<D, kFast>(reg[h][j], s, y, out + (base(m + h) + i) * E);
      }
    }
    for (int64_t c = m - 1; c >= 0; --c) {
      const int k = static_cast<int>(c % kStages);
      if (c < m - kStages) {
        mbar_wait(&bars[k], (parity >> k) & 1u);
        parity ^= 1u << k;
      }
      const uint4* src = ring + int64_t{k} * kChunkVecs;
      const int n = vecs(c);
      uint8_t* dst = out + base(c) * E;
      for (int i = threadIdx.x; i < n; i += kFThreads) encode_vec<D, kFast>(src[i], s, y, dst + int64_t{i} * E);
      if (c >= kStages) {
        __syncthreads();
        if (threadIdx.x == 0) {
          fence_proxy_async();
          issue(c - kStages, first);
          if (c - kStages < m - kStages - kL2Chunks) prefetch(c - kStages - kPrefetch);
        }
      }
    }
  };
  if (fast) {
    pass2(std::true_type{});
  } else {
    pass2(std::false_type{});
  }
  // The last block out leaves the workspace zeroed for the next launch (every block has passed the
  // barriers and read the amax by now).
  if (threadIdx.x == 0 && atomicAdd(p.ws + 1, 1u) == gridDim.x - 1) {
    for (int w = 0; w < 8; ++w) p.ws[w] = 0;
    __threadfence();
  }
#endif
}

// What one device needs: the workspace, the event that orders its launches, the grid size.
struct DeviceState {
  std::mutex mu;
  bool probed = false;
  bool usable = false;
  bool zeroed = false;
  uint32_t* ws = nullptr;
  cudaEvent_t done = nullptr;
  unsigned blocks = 0;  // co-resident blocks of one kernel (the same for the three dtypes)
  int64_t min_bytes = 0;  // the smallest shard (input bytes) taken in one piece
};

DeviceState& device_state(int dev) {
  static std::array<DeviceState, 64> states;
  return states[static_cast<size_t>(dev) % states.size()];
}

template <DType D>
const void* kernel_of() {
  return reinterpret_cast<const void*>(tensor_kernel<D>);
}

// Called with st.mu held.
void probe(DeviceState& st, int dev) {
  st.probed = true;
  int major = 0, sms = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major < 9) return;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return;
  int l2 = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) return;
  int per_sm = 0;
  for (const void* k : {kernel_of<DType::kBF16>(), kernel_of<DType::kF16>(), kernel_of<DType::kF32>()}) {
    // Built without sm_90 code (its body is empty then), or unable to hold the ring: two kernels.
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, k) != cudaSuccess || attr.ptxVersion < 90 ||
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kRingBytes)) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kFThreads, kRingBytes) != cudaSuccess || per_sm < 1) {
      (void)cudaGetLastError();
      return;
    }
  }
  if (cudaMalloc(&st.ws, 32) != cudaSuccess) {
    (void)cudaGetLastError();
    st.ws = nullptr;
    return;
  }
  if (cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  st.blocks = static_cast<unsigned>(sms) * static_cast<unsigned>(per_sm);
  st.min_bytes = std::max<int64_t>(kFusedMinBytes, l2);
  st.usable = true;
}

std::atomic<uint64_t> g_launches{0};

}  // namespace

uint64_t fused_per_tensor_launches() { return g_launches.load(); }

int64_t fused_per_tensor_min_bytes() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  DeviceState& st = device_state(dev);
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.probed) probe(st, dev);
  return st.usable ? st.min_bytes : 0;
}

FusedResult quantize_per_tensor_fused(const QuantArgs& a, const int64_t* begin, size_t shards, cudaStream_t stream,
                                      cudaError_t* error) {
  *error = cudaSuccess;
  const int64_t elem = a.in_dtype == DType::kF32 ? 4 : 2, per_vec = 16 / elem;
  int64_t smallest = INT64_MAX;  // input bytes of the smallest shard
  for (size_t s = 0; s < shards; ++s) smallest = std::min(smallest, (begin[s + 1] - begin[s]) * elem);
  if (smallest < kFusedMinBytes) return FusedResult::kNotUsed;  // before any lock
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return FusedResult::kNotUsed;  // the event that orders the launches cannot be waited on in a capture
  }
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return FusedResult::kNotUsed;
  DeviceState& st = device_state(dev);
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.probed) probe(st, dev);
  if (!st.usable || smallest < st.min_bytes) return FusedResult::kNotUsed;
  if (!st.zeroed) {
    if ((*error = cudaMemsetAsync(st.ws, 0, 32, stream)) != cudaSuccess) return FusedResult::kFailed;
    st.zeroed = true;
  }
  if ((*error = cudaStreamWaitEvent(stream, st.done, 0)) != cudaSuccess) return FusedResult::kFailed;
  const void* kernel = a.in_dtype == DType::kBF16  ? kernel_of<DType::kBF16>()
                       : a.in_dtype == DType::kF16 ? kernel_of<DType::kF16>()
                                                   : kernel_of<DType::kF32>();
  for (size_t s = 0; s < shards; ++s) {
    const int64_t nv = (begin[s + 1] - begin[s]) / per_vec;
    const int64_t chunks = (nv + kChunkVecs - 1) / kChunkVecs;  // at least one per block
    TensorParams p{reinterpret_cast<const uint4*>(static_cast<const char*>(a.in) + begin[s] * elem),
                   static_cast<uint8_t*>(a.out) + begin[s], static_cast<float*>(a.scale) + s, nv, st.ws};
    void* args[] = {&p};
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(st.blocks, chunks));
    const cudaError_t e = cudaLaunchCooperativeKernel(kernel, dim3(grid), dim3(kFThreads), args, kRingBytes, stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (s == 0 && e == cudaErrorCooperativeLaunchTooLarge) {
        st.usable = false;  // fewer SMs than the device reports (MPS, green contexts): two kernels instead
        return FusedResult::kNotUsed;
      }
      *error = e;
      if (s > 0) (void)cudaEventRecord(st.done, stream);  // order the shards that did start
      return FusedResult::kFailed;
    }
    g_launches.fetch_add(1);
  }
  if ((*error = cudaEventRecord(st.done, stream)) != cudaSuccess) return FusedResult::kFailed;
  return FusedResult::kUsed;
}

}  // namespace ferry::kernels::detail::cuda

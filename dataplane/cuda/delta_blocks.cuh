// Block-wise prefix sums for the device delta codec (delta_kernels.cu, delta_runs.cu): a block of
// kScanThreads threads scans its values with warp shuffles; a first launch writes each block's
// total, a one-block launch turns the totals into each block's first offset, and the caller's
// last launch adds a thread's prefix within its block to its block's offset. Sums may saturate at a
// cap (a decoder's sums of untrusted lengths stop at "past the end" instead of wrapping).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/status.h"

namespace ferry::dataplane::detail {
namespace {

#define FERRY_CUDA_LAUNCH_CHECK() FERRY_CUDA_CHECK(cudaGetLastError())

constexpr int kScanThreads = 256;  // a block's threads
constexpr int kWarps = kScanThreads / 32;

template <typename T>
__host__ __device__ __forceinline__ T sat_add(T a, T b, T cap) {
  return a > cap || b > cap - a ? cap : a + b;
}

// Inclusive prefix sum of `v` over the block (saturating at `cap`), and the block's total.
template <typename T>
__device__ __forceinline__ T block_inclusive(T v, T cap, T* total) {
  __shared__ T warp_sums[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc = sat_add(inc, up, cap);
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  T before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before = sat_add(before, warp_sums[w], cap);
    all = sat_add(all, warp_sums[w], cap);
  }
  *total = all;
  return sat_add(before, inc, cap);
}

// Exclusive prefix sum of small counts over the block (no saturation), and the block's total.
__device__ __forceinline__ uint32_t block_exclusive(uint32_t v, uint32_t* total) {
  return block_inclusive<uint32_t>(v, UINT32_MAX, total) - v;
}

// counts[block] = the sum of value(i) over the block's indices i < count.
template <typename T, typename Value>
__global__ void block_totals(Value value, uint64_t count, T cap, T* counts) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  T total = 0;
  block_inclusive<T>(i < count ? value(i) : T{0}, cap, &total);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// One block: offsets[b] = counts[0] + ... + counts[b - 1] (saturating at `cap`), for b in
// [0, blocks]; offsets[blocks] is the sum of all.
template <typename T>
__global__ void block_offsets(const T* counts, uint64_t blocks, uint64_t cap, uint64_t* offsets) {
  const uint64_t per = (blocks + kScanThreads - 1) / kScanThreads;
  const uint64_t lo = threadIdx.x * per, hi = lo + per < blocks ? lo + per : blocks;
  uint64_t sum = 0;
  for (uint64_t b = lo; b < hi; ++b) sum = sat_add<uint64_t>(sum, counts[b], cap);
  // The threads' sums in turn (kScanThreads of them): small next to the counts.
  __shared__ uint64_t sums[kScanThreads];
  sums[threadIdx.x] = sum;
  __syncthreads();
  uint64_t at = 0;
  for (unsigned t = 0; t < threadIdx.x; ++t) at = sat_add(at, sums[t], cap);
  for (uint64_t b = lo; b < hi; ++b) {
    offsets[b] = at;
    at = sat_add<uint64_t>(at, counts[b], cap);
  }
  if (threadIdx.x == kScanThreads - 1) offsets[blocks] = at;
}

// Device scratch for one call, freed in stream order.
struct DeviceScratch {
  void* p = nullptr;
  cudaStream_t st = nullptr;
  Status allocate(size_t bytes, cudaStream_t stream) {
    st = stream;
    FERRY_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    return ok_status();
  }
  ~DeviceScratch() {
    if (p != nullptr) cudaFreeAsync(p, st);
  }
};

// The blocks' totals and offsets of one scan.
template <typename T>
struct Offsets {
  DeviceScratch scratch;
  T* counts = nullptr;
  uint64_t* offsets = nullptr;
};

// Each block's total of value(i) over i < count and each block's first offset (offsets[blocks]:
// the sum of all). 32-bit totals are a block's small counts: the offsets are summed in 64 bits
// without a cap. 64-bit totals and offsets saturate at `cap`.
template <typename T, typename Value>
Status block_offsets_of(Value value, uint64_t count, uint64_t blocks, T cap, cudaStream_t st, Offsets<T>& o) {
  const uint64_t offsets_cap = sizeof(T) < sizeof(uint64_t) ? UINT64_MAX : static_cast<uint64_t>(cap);
  const size_t count_bytes = (blocks * sizeof(T) + 7) / 8 * 8;
  FERRY_RETURN_IF_ERROR(o.scratch.allocate(count_bytes + (blocks + 1) * sizeof(uint64_t), st));
  o.counts = static_cast<T*>(o.scratch.p);
  o.offsets = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(o.scratch.p) + count_bytes);
  block_totals<T><<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(value, count, cap, o.counts);
  block_offsets<T><<<1, kScanThreads, 0, st>>>(o.counts, blocks, offsets_cap, o.offsets);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

Status blocks_for(uint64_t count, uint64_t* blocks) {
  *blocks = (count + kScanThreads - 1) / kScanThreads;
  if (*blocks > 0x7fffffffu) return Status::invalid_argument("device deltas: piece too large");
  return ok_status();
}

// fn(T{}) for the unsigned integer of `elem` bytes.
template <typename Fn>
Status by_width(size_t elem, Fn&& fn) {
  switch (elem) {
    case 1: return fn(uint8_t{});
    case 2: return fn(uint16_t{});
    case 4: return fn(uint32_t{});
    case 8: return fn(uint64_t{});
    default: return Status::invalid_argument("device deltas: elements of 1, 2, 4 or 8 bytes");
  }
}

}  // namespace
}  // namespace ferry::dataplane::detail

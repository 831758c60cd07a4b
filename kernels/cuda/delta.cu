// Delta updates on the device (kernels/delta.h): the trainer's compare against its device copy,
// and the write of a delta's changed elements into a rank's device shadow.
//
// The compare runs in three launches: each thread takes 8 elements (one bitmap byte) and each block
// 2048 elements; the first counts the changed elements per block, the second turns the counts into
// each block's first value (one block), the third writes the bitmap bytes and the values, each
// thread at its block's offset plus the changed elements of the threads before it.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/delta.h"
#include "kernels/internal.h"

namespace ferry::kernels::detail::cuda {
namespace {

constexpr int kScanThreads = 256;  // a block's threads; each one bitmap byte (8 elements)
constexpr int kElemsPerBlock = kScanThreads * 8;
constexpr int kWarps = kScanThreads / 32;

template <typename T>
__device__ __forceinline__ uint32_t changed_byte(const T* before, const T* after, uint64_t e, uint64_t n) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (e + j < n && before[e + j] != after[e + j]) m |= 1u << j;
  }
  return m;
}

// Exclusive prefix sum of `v` over the block, and the block's total.
__device__ __forceinline__ uint32_t block_exclusive(uint32_t v, uint32_t* total) {
  __shared__ uint32_t warp_sums[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += up;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  uint32_t before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  *total = all;
  return before + inc - v;
}

template <typename T>
__global__ void count_changes(const T* before, const T* after, uint64_t n, uint32_t* counts) {
  const uint64_t e = (static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x) * 8;
  uint32_t total = 0;
  block_exclusive(__popc(changed_byte(before, after, e, n)), &total);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// One block: offsets[b] = counts[0] + ... + counts[b - 1], for b in [0, blocks]; offsets[blocks]
// is every change.
__global__ void block_offsets(const uint32_t* counts, uint64_t blocks, uint64_t* offsets) {
  const uint64_t per = (blocks + kScanThreads - 1) / kScanThreads;
  const uint64_t lo = threadIdx.x * per, hi = lo + per < blocks ? lo + per : blocks;
  uint64_t sum = 0;
  for (uint64_t b = lo; b < hi; ++b) sum += counts[b];
  // The threads' sums in turn (kScanThreads of them): small next to the counts.
  __shared__ uint64_t sums[kScanThreads];
  sums[threadIdx.x] = sum;
  __syncthreads();
  uint64_t at = 0;
  for (unsigned t = 0; t < threadIdx.x; ++t) at += sums[t];
  for (uint64_t b = lo; b < hi; ++b) {
    offsets[b] = at;
    at += counts[b];
  }
  if (threadIdx.x == kScanThreads - 1) offsets[blocks] = at;
}

template <typename T, bool Xor>
__global__ void write_changes(const T* before, const T* after, uint64_t n, const uint64_t* offsets, uint8_t* bitmap,
                              T* values) {
  const uint64_t byte = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  const uint64_t e = byte * 8;
  const uint32_t m = changed_byte(before, after, e, n);
  uint32_t total = 0;
  uint64_t at = offsets[blockIdx.x] + block_exclusive(__popc(m), &total);
  if (e < n) bitmap[byte] = static_cast<uint8_t>(m);
  for (uint32_t b = m; b != 0; b &= b - 1) {
    const uint64_t i = e + static_cast<uint64_t>(__ffs(b) - 1);
    values[at++] = Xor ? static_cast<T>(after[i] ^ before[i]) : after[i];
  }
}

template <typename T, bool Xor>
__global__ void scatter_chunks(T* dst, const DeltaChunk* chunks, uint64_t count, const T* values) {
  const uint64_t c = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (c >= count) return;
  const DeltaChunk k = chunks[c];
  for (uint32_t i = threadIdx.x & 31; i < k.count; i += 32) {
    if constexpr (Xor) {
      dst[k.first + i] ^= values[k.value + i];
    } else {
      dst[k.first + i] = values[k.value + i];
    }
  }
}

// fn(T{}) for the unsigned integer of `elem` bytes.
template <typename Fn>
Status by_width(size_t elem, Fn&& fn) {
  switch (elem) {
    case 1: return fn(uint8_t{});
    case 2: return fn(uint16_t{});
    case 4: return fn(uint32_t{});
    case 8: return fn(uint64_t{});
    default: return Status::invalid_argument("delta kernels: elements of 1, 2, 4 or 8 bytes");
  }
}

}  // namespace

Status scan_changes(const void* before, const void* after, uint64_t n, size_t elem, bool xor_values, void* bitmap,
                    void* values, uint64_t* changed, void* stream) {
  *changed = 0;
  if (n == 0) return ok_status();
  const cudaStream_t st = as_stream(stream);
  const uint64_t blocks = (n + kElemsPerBlock - 1) / kElemsPerBlock;
  if (blocks > 0x7fffffffu) return Status::invalid_argument("delta kernels: piece too large");
  void* scratch = nullptr;
  const size_t count_bytes = (blocks * sizeof(uint32_t) + 7) / 8 * 8;
  FERRY_CUDA_CHECK(cudaMallocAsync(&scratch, count_bytes + (blocks + 1) * sizeof(uint64_t), st));
  auto* counts = static_cast<uint32_t*>(scratch);
  auto* offsets = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(scratch) + count_bytes);
  const Status launched = by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    const auto* b = static_cast<const T*>(before);
    const auto* a = static_cast<const T*>(after);
    count_changes<T><<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(b, a, n, counts);
    block_offsets<<<1, kScanThreads, 0, st>>>(counts, blocks, offsets);
    if (xor_values) {
      write_changes<T, true><<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(
          b, a, n, offsets, static_cast<uint8_t*>(bitmap), static_cast<T*>(values));
    } else {
      write_changes<T, false><<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(
          b, a, n, offsets, static_cast<uint8_t*>(bitmap), static_cast<T*>(values));
    }
    FERRY_CUDA_LAUNCH_CHECK();
    return ok_status();
  });
  Status copied = launched;
  if (copied.ok()) {
    const cudaError_t e = cudaMemcpyAsync(changed, offsets + blocks, sizeof(uint64_t), cudaMemcpyDeviceToHost, st);
    if (e != cudaSuccess) copied = Status::internal(cudaGetErrorString(e));
  }
  FERRY_CUDA_CHECK(cudaFreeAsync(scratch, st));
  FERRY_RETURN_IF_ERROR(copied);
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  return ok_status();
}

Status scatter_delta(void* dst, size_t elem, const DeltaChunk* chunks, uint64_t count, const void* values,
                     bool xor_values, void* stream) {
  if (count == 0) return ok_status();
  const cudaStream_t st = as_stream(stream);
  constexpr uint64_t kChunksPerBlock = 8;  // a warp each
  const uint64_t blocks = (count + kChunksPerBlock - 1) / kChunksPerBlock;
  if (blocks > 0x7fffffffu) return Status::invalid_argument("delta kernels: too many chunks");
  return by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    if (xor_values) {
      scatter_chunks<T, true><<<static_cast<unsigned>(blocks), 32 * kChunksPerBlock, 0, st>>>(
          static_cast<T*>(dst), chunks, count, static_cast<const T*>(values));
    } else {
      scatter_chunks<T, false><<<static_cast<unsigned>(blocks), 32 * kChunksPerBlock, 0, st>>>(
          static_cast<T*>(dst), chunks, count, static_cast<const T*>(values));
    }
    FERRY_CUDA_LAUNCH_CHECK();
    FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
    return ok_status();
  });
}

}  // namespace ferry::kernels::detail::cuda

// The delta codec on the device (dataplane/delta_device.h): the trainer's compare against its device copy,
// and the write of a delta's changed elements into a rank's device shadow.
//
// Both run in three launches over bitmap bytes, each thread one byte (8 elements), each block 256
// bytes: the first counts the set bits per block (of the compare, or of the delta's bitmap), the
// second turns the counts into each block's first value (one block), the third writes: the bitmap
// and the changed values (compare), or the values over the old ones (apply), each thread at its
// block's offset plus the bits of the threads before it.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "dataplane/delta_device.h"

namespace ferry::dataplane::detail {
namespace {

#define FERRY_CUDA_LAUNCH_CHECK() FERRY_CUDA_CHECK(cudaGetLastError())

constexpr int kScanThreads = 256;  // a block's threads; each one bitmap byte (8 elements)
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

// A thread's bitmap byte: the elements that differ (the compare), or the delta's own bitmap.
template <typename T>
struct Differ {
  const T* before;
  const T* after;
  uint64_t n;
  __device__ uint32_t operator()(uint64_t byte) const { return changed_byte(before, after, byte * 8, n); }
};
struct Bits {
  const uint8_t* bitmap;
  __device__ uint32_t operator()(uint64_t byte) const { return bitmap[byte]; }
};

template <typename Byte>
__global__ void count_bits(Byte byte_of, uint64_t bytes, uint32_t* counts) {
  const uint64_t byte = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  uint32_t total = 0;
  block_exclusive(byte < bytes ? __popc(byte_of(byte)) : 0, &total);
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
__global__ void apply_bits(T* dst, const uint8_t* bitmap, uint64_t bytes, const uint64_t* offsets, const T* values) {
  const uint64_t byte = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  const uint32_t m = byte < bytes ? bitmap[byte] : 0;
  uint32_t total = 0;
  uint64_t at = offsets[blockIdx.x] + block_exclusive(__popc(m), &total);
  for (uint32_t b = m; b != 0; b &= b - 1) {
    const uint64_t i = byte * 8 + static_cast<uint64_t>(__ffs(b) - 1);
    if constexpr (Xor) {
      dst[i] ^= values[at++];
    } else {
      dst[i] = values[at++];
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
    default: return Status::invalid_argument("device deltas: elements of 1, 2, 4 or 8 bytes");
  }
}

// Device scratch for one call: the blocks' counts and offsets, freed in stream order.
struct Offsets {
  void* scratch = nullptr;
  uint32_t* counts = nullptr;
  uint64_t* offsets = nullptr;
  cudaStream_t st = nullptr;
  ~Offsets() {
    if (scratch != nullptr) cudaFreeAsync(scratch, st);
  }
};

// Counts the bits of each block's bytes and each block's first value (offsets[blocks]: all of them).
template <typename Byte>
Status block_offsets_of(Byte byte_of, uint64_t bytes, uint64_t blocks, cudaStream_t st, Offsets& o) {
  o.st = st;
  const size_t count_bytes = (blocks * sizeof(uint32_t) + 7) / 8 * 8;
  FERRY_CUDA_CHECK(cudaMallocAsync(&o.scratch, count_bytes + (blocks + 1) * sizeof(uint64_t), st));
  o.counts = static_cast<uint32_t*>(o.scratch);
  o.offsets = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(o.scratch) + count_bytes);
  count_bits<<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(byte_of, bytes, o.counts);
  block_offsets<<<1, kScanThreads, 0, st>>>(o.counts, blocks, o.offsets);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

Status blocks_for(uint64_t bytes, uint64_t* blocks) {
  *blocks = (bytes + kScanThreads - 1) / kScanThreads;
  if (*blocks > 0x7fffffffu) return Status::invalid_argument("device deltas: piece too large");
  return ok_status();
}

}  // namespace

Status scan_changes(int device, const void* before, const void* after, uint64_t n, size_t elem, bool xor_values,
                    void* bitmap, void* values, uint64_t* changed) {
  *changed = 0;
  if (n == 0) return ok_status();
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  const cudaStream_t st = nullptr;  // the legacy default stream: after the work of other blocking streams
  const uint64_t bytes = (n + 7) / 8;
  uint64_t blocks = 0;
  FERRY_RETURN_IF_ERROR(blocks_for(bytes, &blocks));
  Offsets o;
  FERRY_RETURN_IF_ERROR(by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    const Differ<T> differ{static_cast<const T*>(before), static_cast<const T*>(after), n};
    FERRY_RETURN_IF_ERROR(block_offsets_of(differ, bytes, blocks, st, o));
    const auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(
          differ.before, differ.after, n, o.offsets, static_cast<uint8_t*>(bitmap), static_cast<T*>(values));
    };
    if (xor_values) {
      launch(write_changes<T, true>);
    } else {
      launch(write_changes<T, false>);
    }
    FERRY_CUDA_LAUNCH_CHECK();
    return ok_status();
  }));
  FERRY_CUDA_CHECK(cudaMemcpyAsync(changed, o.offsets + blocks, sizeof(uint64_t), cudaMemcpyDeviceToHost, st));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  return ok_status();
}

Status apply_bitmap(int device, void* dst, uint64_t n, size_t elem, const uint8_t* bitmap, const void* values,
                    bool xor_values) {
  if (n == 0) return ok_status();
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  const cudaStream_t st = nullptr;
  const uint64_t bytes = (n + 7) / 8;
  uint64_t blocks = 0;
  FERRY_RETURN_IF_ERROR(blocks_for(bytes, &blocks));
  Offsets o;
  FERRY_RETURN_IF_ERROR(block_offsets_of(Bits{bitmap}, bytes, blocks, st, o));
  FERRY_RETURN_IF_ERROR(by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    const auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(static_cast<T*>(dst), bitmap, bytes, o.offsets,
                                                                     static_cast<const T*>(values));
    };
    if (xor_values) {
      launch(apply_bits<T, true>);
    } else {
      launch(apply_bits<T, false>);
    }
    FERRY_CUDA_LAUNCH_CHECK();
    return ok_status();
  }));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  return ok_status();
}

}  // namespace ferry::dataplane::detail

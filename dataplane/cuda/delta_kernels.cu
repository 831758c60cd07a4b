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
#include <vector>

#include "core/cuda_check.h"
#include "dataplane/cuda/delta_blocks.cuh"
#include "dataplane/delta_device.h"

namespace ferry::dataplane::detail {
namespace {

template <typename T>
__device__ __forceinline__ uint32_t changed_byte(const T* before, const T* after, uint64_t e, uint64_t n) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (e + j < n && before[e + j] != after[e + j]) m |= 1u << j;
  }
  return m;
}

// The set bits of a thread's bitmap byte: the elements that differ (the compare), or the delta's own
// bitmap.
template <typename T>
struct Differ {
  const T* before;
  const T* after;
  uint64_t n;
  __device__ uint32_t operator()(uint64_t byte) const { return __popc(changed_byte(before, after, byte * 8, n)); }
};
struct Bits {
  const uint8_t* bitmap;
  __device__ uint32_t operator()(uint64_t byte) const { return __popc(bitmap[byte]); }
};

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

// `rows` (when not null): a byte per row of `per_row` elements, set for each row the thread writes
// in (the first and last of its byte's elements decide, unless a row ends between them).
template <typename T, bool Xor>
__global__ void apply_bits(T* dst, const uint8_t* bitmap, uint64_t bytes, const uint64_t* offsets, const T* values,
                           uint8_t* rows, uint64_t per_row) {
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
  if (rows != nullptr && m != 0) {
    const uint64_t first = (byte * 8 + static_cast<uint64_t>(__ffs(m) - 1)) / per_row;
    const uint64_t last = (byte * 8 + static_cast<uint64_t>(31 - __clz(m))) / per_row;
    if (first == last) {
      rows[first] = 1;
    } else {
      for (uint32_t b = m; b != 0; b &= b - 1) rows[(byte * 8 + static_cast<uint64_t>(__ffs(b) - 1)) / per_row] = 1;
    }
  }
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
  Offsets<uint32_t> o;
  FERRY_RETURN_IF_ERROR(by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    const Differ<T> differ{static_cast<const T*>(before), static_cast<const T*>(after), n};
    FERRY_RETURN_IF_ERROR(block_offsets_of<uint32_t>(differ, bytes, blocks, UINT32_MAX, st, o));
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

Status copy_in_order(int device, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return ok_status();
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  FERRY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, nullptr));
  return ok_status();
}

Status wait_in_order(int device) {
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  FERRY_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return ok_status();
}

Status apply_bitmap(int device, void* dst, uint64_t n, size_t elem, const uint8_t* bitmap, const void* values,
                    bool xor_values, const RowMarks* rows) {
  if (n == 0) return ok_status();
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  const cudaStream_t st = nullptr;
  const uint64_t bytes = (n + 7) / 8;
  uint64_t blocks = 0;
  FERRY_RETURN_IF_ERROR(blocks_for(bytes, &blocks));
  Offsets<uint32_t> o;
  FERRY_RETURN_IF_ERROR(block_offsets_of<uint32_t>(Bits{bitmap}, bytes, blocks, UINT32_MAX, st, o));
  // The rows' marks on the device, cleared, then brought back to the host's after the write.
  const uint64_t row_count = rows != nullptr ? (n + rows->per_row - 1) / rows->per_row : 0;
  DeviceScratch marks;
  if (row_count > 0) {
    FERRY_RETURN_IF_ERROR(marks.allocate(row_count, st));
    FERRY_CUDA_CHECK(cudaMemsetAsync(marks.p, 0, row_count, st));
  }
  FERRY_RETURN_IF_ERROR(by_width(elem, [&](auto t) -> Status {
    using T = decltype(t);
    const auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(blocks), kScanThreads, 0, st>>>(
          static_cast<T*>(dst), bitmap, bytes, o.offsets, static_cast<const T*>(values), static_cast<uint8_t*>(marks.p),
          row_count > 0 ? rows->per_row : 1);
    };
    if (xor_values) {
      launch(apply_bits<T, true>);
    } else {
      launch(apply_bits<T, false>);
    }
    FERRY_CUDA_LAUNCH_CHECK();
    return ok_status();
  }));
  std::vector<uint8_t> marked(row_count);
  if (row_count > 0) {
    FERRY_CUDA_CHECK(cudaMemcpyAsync(marked.data(), marks.p, row_count, cudaMemcpyDeviceToHost, st));
  }
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  for (uint64_t i = 0; i < row_count; ++i) rows->marks[i] |= marked[i];
  return ok_status();
}

}  // namespace ferry::dataplane::detail

// The delta codec on a CUDA device: the compare a trainer runs against a copy of the version a rank
// holds kept in device memory (FERRY_DELTA_COPY=device), and the write of a delta's changed elements
// into a rank's shadow in device memory (FERRY_DELTA_SHADOW=device). Elements compare and move as
// bytes (1, 2, 4 or 8 per element), so the results are bit for bit the host codec's (delta.h).
// Unavailable on a build without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/buffer.h"
#include "core/status.h"

namespace ferry::dataplane {

// Device buffers of the codec place their parts at 16-byte boundaries.
inline size_t round16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Compares `n` elements of `elem` bytes of `before` and `after` (device memory of `device`) and
// writes the bitmap of those that differ to `bitmap` (device memory, ceil(n / 8) bytes: element i
// as bit i % 8 of byte i / 8, bits past n clear) and their new values, in element order, to
// `values` (device memory, room for n elements; with `xor_values`, new XOR old). Returns how many
// changed, once written. `elem` must be 1, 2, 4 or 8.
Result<uint64_t> scan_changes_on_device(int device, const void* before, const void* after, size_t n, size_t elem,
                                        bool xor_values, void* bitmap, void* values);

// The runs of the bitmap scan_changes_on_device() wrote (`bitmap`, device memory of `device`, n
// elements, 8-byte aligned, read in whole 64-bit words: room for (n + 63) / 64 * 8 bytes, bits past
// n ignored), found on the device, as the host's runs encoding has them (delta.h): their count, and
// the bytes of their pairs of varints (skip, length). Those are written into `pairs` (device
// memory, grown as needed) only when `written`: when the count's varint and the pairs take no more
// than `limit` bytes (the choice of choose_delta() with the bitmap's size as the limit). Runs too
// many for that even at two bytes a pair are not listed: `pair_bytes` is then 0.
struct DeviceRuns {
  uint64_t runs = 0;
  size_t pair_bytes = 0;
  bool written = false;
};
Result<DeviceRuns> runs_on_device(int device, const uint8_t* bitmap, size_t n, size_t limit, Buffer& pairs);

// The rows a delta's write changed, noted as it writes: its n elements are rows of `per_row`, and
// `marks` (host memory, ceil(n / per_row) bytes) gets a 1 for each row an element of which the
// delta writes; other bytes are left as they were. A rank re-processes only those rows then.
struct RowMarks {
  uint64_t per_row = 0;
  uint8_t* marks = nullptr;
};

// Writes a delta into `dst` (device memory of `device`, n elements of `elem` bytes): element i takes
// the next of `values` (or XORs it in, with `xor_values`) when bit i of `bitmap` is set. `bitmap`
// (ceil(n / 8) bytes, bits past n clear) and `values` (as many as the bitmap marks) are device
// memory. Returns once written (and `rows`, when given, marked). `elem` must be 1, 2, 4 or 8.
Status apply_bitmap_on_device(int device, void* dst, size_t n, size_t elem, const uint8_t* bitmap, const void* values,
                              bool xor_values, const RowMarks* rows = nullptr);

// apply_delta() (delta.h) for `values` in device memory: the encoding (a piece's encoding field
// and bytes, on the host) is checked and decoded on the host into the bitmap of its changed
// elements (delta_bitmap), which crosses to the device with their values through `upload` (device
// memory there, grown as needed), and apply_bitmap_on_device() writes them. DataLoss, and nothing
// written, for an encoding that does not describe n elements.
Status apply_delta_on_device(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, void* values, Device device,
                             size_t n, size_t elem, Buffer& upload, const RowMarks* rows = nullptr);

// apply_delta_on_device() for a runs encoding without flags that lies in device memory of `device`
// (a device bucket's payload), its values from `values_at` (the sender's word, untrusted): only its
// count crosses to the host; its pairs and values are copied on the device and decoded and checked
// there. DataLoss, and nothing written, when the device refuses it or `values_at` does not fit;
// the caller then walks it on the host, which says why. InvalidArgument for another encoding.
Status apply_device_runs(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, uint64_t values_at, void* values,
                         Device device, size_t n, size_t elem, Buffer& upload, const RowMarks* rows = nullptr);

namespace detail {
// The CUDA side (cuda/delta_kernels.cu), or Unavailable (delta_device_unavailable.cc).
// Each runs with `device` current and puts the caller's back.
Status scan_changes(int device, const void* before, const void* after, uint64_t n, size_t elem, bool xor_values,
                    void* bitmap, void* values, uint64_t* changed);
// runs_on_device() once `pairs` has room for the limit. The pairs are written in order on the
// legacy default stream: read them there (copy_bytes does).
Status find_runs(int device, const uint8_t* bitmap, uint64_t n, uint64_t limit, uint8_t* pairs, DeviceRuns* found);
// `bytes` from `src` (host or device memory) into device memory of `device`, queued on the legacy
// default stream, so that the kernels above see them, without waiting for them to land. A pageable
// host source may be reused once this returns (CUDA has staged it by then).
Status copy_in_order(int device, void* dst, const void* src, size_t bytes);
// Waits for everything queued on `device`'s legacy default stream.
Status wait_in_order(int device);
Status apply_bitmap(int device, void* dst, uint64_t n, size_t elem, const uint8_t* bitmap, const void* values,
                    bool xor_values, const RowMarks* rows);
// apply_bitmap() for a runs encoding's r pairs of varints (`pairs`, pair_bytes, device memory: the
// host found their ends, the device decodes and checks them) and its k `values` (device memory):
// DataLoss, and nothing written, unless every varint is at most 10 bytes, every length at least 1,
// the runs end within n elements and cover k.
Status apply_runs(int device, void* dst, uint64_t n, size_t elem, const uint8_t* pairs, uint64_t pair_bytes, uint64_t r,
                  const void* values, uint64_t k, bool xor_values, const RowMarks* rows);
}  // namespace detail

}  // namespace ferry::dataplane

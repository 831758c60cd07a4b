// Delta updates on a CUDA device: the compare a trainer runs against the copy of the version a rank
// holds (dataplane/delta.h's scan, where both live in device memory), and the write of a delta's
// changed elements into a rank's device shadow. Elements are compared and moved as bytes (1, 2, 4
// or 8 per element), so the result is bit for bit the host codec's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/status.h"
#include "kernels/quantize.h"

namespace ferry::kernels {

// Compares `n` elements of `elem` bytes of `before` and `after` (device memory of `device`) and
// writes the bitmap of those that differ to `bitmap` (device memory, ceil(n / 8) bytes: element i
// as bit i % 8 of byte i / 8, bits past n clear) and their new values, in element order, to
// `values` (device memory, room for n elements; with `xor_values`, new XOR old). Returns how many
// changed, once the work on exec.stream has finished. `elem` must be 1, 2, 4 or 8.
Result<uint64_t> scan_changes_on_device(int device, const void* before, const void* after, size_t n, size_t elem,
                                        bool xor_values, void* bitmap, void* values, const Exec& exec = {});

// A run of a delta's changed elements: elements [first, first + count) of the destination take
// values [value, value + count).
struct DeltaChunk {
  uint64_t first = 0;
  uint32_t count = 0;
  uint64_t value = 0;
};
// A delta's changed elements, decoded on the host from a piece's encoding (dataplane::delta_runs),
// for a destination in device memory: runs [first, first + count) of elements in order, and the
// new values (or XORs with the old) of all of them, in the same order.
struct DeltaRuns {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  const uint8_t* values = nullptr;  // into the encoding, or into `inflated`
  uint64_t changed = 0;
  bool xor_values = false;
  std::vector<uint8_t> inflated;  // a zstd frame's contents
};

// Chunks longer than this are split, so that one warp's share stays small.
inline constexpr uint32_t kDeltaChunkElements = 1024;

// Writes `chunks` (device memory) of elements of `elem` bytes into `dst` (device memory): each
// element takes its value, or XORs it in with `xor_values`. Returns once the writes on exec.stream
// have landed.
// The chunks must lie inside the destination and the values; the caller checks them.
Status scatter_delta_on_device(int device, void* dst, size_t elem, const DeltaChunk* chunks, size_t count,
                               const void* values, bool xor_values, const Exec& exec = {});

}  // namespace ferry::kernels

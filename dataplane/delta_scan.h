// The delta codec's scans, which its encoders (delta.cc) run over a piece: the compare of its old
// and new elements into a bitmap of the changed ones and their values, and the runs of such a
// bitmap as varint pairs, each on several threads for a large piece. Internal to the data plane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/parallel.h"

namespace ferry::dataplane::detail {

// Memory a thread reuses from piece to piece, left uninitialised (only what is written is read),
// and given back when a large piece grew it past 64 MiB.
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      data_.reset(new uint8_t[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }
  uint8_t* data() const { return data_.get(); }
  void trim() {
    if (size_ > (size_t{64} << 20)) data_.reset(), size_ = 0;
  }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

inline uint8_t* put_varint(uint8_t* w, uint64_t v) {
  while (v >= 0x80) *w++ = static_cast<uint8_t>(v | 0x80), v >>= 7;
  *w++ = static_cast<uint8_t>(v);
  return w;
}

// Reads one varint of at most 10 bytes from [*p, end); false when it runs off the end or is longer.
inline bool get_varint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    const uint8_t b = *(*p)++;
    x |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *v = x;
      return true;
    }
  }
  return false;
}

// Room for the bitmap of n elements, padded with clear bits to whole 64-bit words (for_each_run).
inline uint8_t* scan_bitmap(Scratch& memory, size_t n) {
  uint8_t* bitmap = memory.get((n + 63) / 64 * 8 + 16);
  std::memset(bitmap + (n + 7) / 8 / 8 * 8, 0, 16);
  return bitmap;
}

// Room past a runs limit: a run's pair (20 bytes at most) may be written past it before the limit is
// checked.
inline constexpr size_t kRunsSlack = 64;

// The compares the scans may use, one per CPU level: 64 bytes a side at a time where the CPU has
// AVX-512 (BW and VBMI2), 32 where it has AVX2, else 16 (SSE2, every x86-64) or an element at a
// time. The wide ones close the changed values up without a branch per element. The results are
// the same; the fastest one the CPU has is in use unless use_scan() chose another (tests of each).
enum class ScanKind : uint8_t { kNarrow, kAvx2, kAvx512 };
// Those this CPU runs, the fastest first (kNarrow last, always).
std::vector<ScanKind> scans_available();
// Makes this process scan with `kind` (one of scans_available()); returns the one in use before.
ScanKind use_scan(ScanKind kind);
const char* scan_name(ScanKind kind);

// Scans n elements of `elem` bytes of `before` and `after`: the changed ones' bits into `bitmap`
// (element i as bit i % 8 of byte i / 8; bits past n clear; scan_bitmap() gives room) and their new
// values (with `xor_values`, new XOR old), in order, to `values` (room for n values: the wide
// compares store whole vectors there, never past that room). Returns how many changed. A piece of
// 256 Ki elements or more is scanned in slices of at least 128 Ki on up to 16 of the work pool's
// threads (core/work_pool.h, within host_threads()), the caller's among them.
uint64_t scan_parallel(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                       uint8_t* bitmap, uint8_t* values);

// scan_parallel() on the calling thread alone, for a caller that shares the work out itself
// (tensor_scan.h). The same room rules: `values` holds n values. `rare`: whether changes were rare
// in the elements scanned just before (true to begin with): the wide compares choose how to scan
// by it, and leave it set for the next call.
uint64_t scan_serial(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                     uint8_t* bitmap, uint8_t* values, bool& rare);

// The runs of the n bits of `bitmap` (padded with clear bits to whole 64-bit words) as varint pairs
// (skip, length) into `runs` (room for limit + kRunsSlack bytes): their count and the bytes written,
// or nullopt once those pass `limit`. A large bitmap is cut into slices of whole words (as the
// compare's), each encoded on a thread of the work pool: a slice's first run is kept apart (its skip depends on where
// the slice before ended, and a run across the border is one run), as is its last (the next slice's first may continue
// it); the pairs between go as they are.
std::optional<std::pair<uint64_t, size_t>> runs_of(const uint8_t* bitmap, size_t n, size_t limit, uint8_t* runs);

// The runs of bits [lo, hi) of a bitmap (lo a multiple of 64; hi too, or the bitmap's end, padded
// with clear bits to a whole word), found on a thread of their own, to be joined with the runs of
// the slices around them (join_runs): the first run kept apart (its skip depends on where the
// slice before ended, and a run across the border is one run), as is the last (the next slice's
// first may continue it); the pairs between written to `pairs` (room for limit + kRunsSlack bytes)
// as they are. Positions are the bitmap's.
struct RunsSlice {
  uint64_t count = 0;
  uint64_t first_start = 0, first_end = 0, last_start = 0, last_end = 0, before_last_end = 0;
  size_t last_at = 0;  // where the last run's pair starts in `pairs` (those of runs 2, 3, ...)
  size_t bytes = 0;
  bool over = false;  // the pairs passed `limit` (and the slice stopped there)
};
RunsSlice slice_runs(const uint8_t* bitmap, size_t lo, size_t hi, size_t limit, uint8_t* pairs);
// The runs of consecutive slices, in order, as runs_of() writes them; nullopt once they pass `limit`.
std::optional<std::pair<uint64_t, size_t>> join_runs(const RunsSlice* slices, const uint8_t* const* pairs, size_t count,
                                                     size_t limit, uint8_t* runs);

// Past the first `count` varints from p (a varint ends at its first byte under 0x80); nullptr when
// `end` comes first.
const uint8_t* past_varints(const uint8_t* p, const uint8_t* end, uint64_t count);

// The most chunks split_runs() cuts an encoding into.
inline constexpr size_t kMaxRunsChunks = 8;

// A share of a runs encoding's pairs, decoded as one piece of a job on the work pool.
struct RunsChunk {
  const uint8_t* begin = nullptr;  // its first pair
  const uint8_t* end = nullptr;    // past its last pair
  uint64_t pairs = 0;
  uint64_t at = 0;     // the element its first skip counts from
  uint64_t value = 0;  // the index of its first run's first value
  uint64_t stop = 0;   // past its last run's last element
  size_t index = 0;
  bool alone = true;  // the only one: no other chunk's elements share a bitmap byte with its own
};
struct RunsSplit {
  std::vector<RunsChunk> chunks;
  const uint8_t* values = nullptr;  // where the values begin
  uint64_t changed = 0;             // how many
};
// The r pairs of a runs encoding at `pairs` (its count read; values follow up to `end`) cut at pair
// borders into up to kMaxRunsChunks chunks, each checked as one piece of a job on the work pool: every pair two varints
// of at most 10 bytes, every length at least 1, the runs ending within n elements, as many values of `elem` bytes
// following as they cover. nullopt when the pairs are too few to share out, or when a check fails (a single pass over
// the encoding then says which, as for a small one).
std::optional<RunsSplit> split_runs(const uint8_t* pairs, const uint8_t* end, uint64_t r, size_t n, size_t elem);

}  // namespace ferry::dataplane::detail

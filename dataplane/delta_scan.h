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

// Room for the bitmap of n elements, padded with clear bits to whole 64-bit words (for_each_run).
inline uint8_t* scan_bitmap(Scratch& memory, size_t n) {
  uint8_t* bitmap = memory.get((n + 63) / 64 * 8 + 16);
  std::memset(bitmap + (n + 7) / 8 / 8 * 8, 0, 16);
  return bitmap;
}

// Room past a runs limit: a run's pair (20 bytes at most) may be written past it before the limit is
// checked.
inline constexpr size_t kRunsSlack = 64;

// Scans n elements of `elem` bytes of `before` and `after`: the changed ones' bits into `bitmap`
// (element i as bit i % 8 of byte i / 8; bits past n clear; scan_bitmap() gives room) and their new
// values (with `xor_values`, new XOR old), in order, to `values`. Returns how many changed. A piece
// of several Mi elements is scanned on up to 8 threads.
uint64_t scan_parallel(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                       uint8_t* bitmap, uint8_t* values);

// The runs of the n bits of `bitmap` (padded with clear bits to whole 64-bit words) as varint pairs
// (skip, length) into `runs` (room for limit + kRunsSlack bytes): their count and the bytes written,
// or nullopt once those pass `limit`. A large bitmap is cut into slices of whole words, each
// encoded on a thread of its own: a slice's first run is kept apart (its skip depends on where the
// slice before ended, and a run across the border is one run), as is its last (the next slice's
// first may continue it); the pairs between go as they are.
std::optional<std::pair<uint64_t, size_t>> runs_of(const uint8_t* bitmap, size_t n, size_t limit, uint8_t* runs);

}  // namespace ferry::dataplane::detail

// Delta pieces: a piece's elements sent as only those that changed since a version the rank holds.
// Lossless: applied on top of the old values of the same region, the result is exactly the new
// values, byte for byte. Elements compare as bytes (bf16 -0.0 and 0.0 differ, as do NaN payloads),
// so what a rank ends up with is what a dense piece would have carried.
//
// Encodings of n elements of `elem` bytes, k of which changed (values in element order):
//   bitmap: ceil(n / 8) bytes, bit i (LSB first) set when element i changed; then k values.
//   runs:   varint r, then r pairs of varints (skip, length >= 1): elements left as they are, then
//           changed ones; then k values (k = sum of lengths).
// The sender takes the smaller of these and the dense bytes (encode_delta); the receiver checks
// every count and bound before it writes an element (apply_delta), since the bytes come off a wire.
//
// A piece's encoding field may carry two flags beside the encoding:
//   kDeltaXor:  each value is the new element XOR the old one (a step of Adam moves a bf16 value by
//               an ulp or two, so most of these bytes are zero or small: they compress well);
//   kDeltaZstd: the encoding's bytes are one zstd frame that states its content size (FERRY_DELTA_ZSTD),
//               no larger than the bitmap encoding with every value.
// With FERRY_DELTA_ZSTD a sender sets kDeltaXor on every delta piece, and kDeltaZstd on those whose
// frame saves an eighth (compress_delta); the receiver takes any combination.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ferry::dataplane {

enum class DeltaEncoding : uint32_t { kDense = 0, kBitmap = 1, kRuns = 2 };
inline constexpr uint32_t kDeltaXor = 0x100;
inline constexpr uint32_t kDeltaZstd = 0x200;

struct DeltaChoice {
  DeltaEncoding encoding = DeltaEncoding::kDense;
  uint64_t changed = 0;  // elements that differ
};

// Compares `n` elements of `elem` bytes of `before` and `after`, and writes into `out` the
// smallest of the delta encodings. kDense (and `out` empty) when the dense bytes are no larger,
// unless `prefer_delta` (FERRY_DELTA=always), which keeps the smaller delta encoding anyway.
// `xor_values`: the values written are new XOR old (kDeltaXor).
DeltaChoice encode_delta(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool prefer_delta,
                         std::vector<uint8_t>& out, bool xor_values = false);

// encode_delta's choice for a scan made elsewhere (on a device, delta_device.h): `bitmap` of the n
// elements (padded with clear bits to whole 64-bit words) and the k changed `values` in order.
DeltaChoice encode_scanned(const uint8_t* bitmap, const uint8_t* values, uint64_t k, size_t n, size_t elem,
                           bool prefer_delta, std::vector<uint8_t>& out);

// encode_scanned() with the runs found already (runs_of(), join_runs(): `found`, their pairs at
// `runs`), and the k values in pieces, in order.
struct ValueSpan {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};
DeltaChoice encode_found(const uint8_t* bitmap, std::span<const ValueSpan> values, uint64_t k, size_t n, size_t elem,
                         bool prefer_delta, std::optional<std::pair<uint64_t, size_t>> found, const uint8_t* runs,
                         std::vector<uint8_t>& out);

// The choice encode_delta (and encode_scanned) makes for k changed of n elements of `elem` bytes,
// given their runs (count, and their pairs' bytes; nullopt once those passed the bitmap's size):
// runs when the count's varint and the pairs take no more bytes than the bitmap, else the bitmap;
// kDense when that is no smaller than the dense bytes, unless `prefer_delta`.
DeltaEncoding choose_delta(uint64_t k, size_t n, size_t elem, bool prefer_delta,
                           std::optional<std::pair<uint64_t, size_t>> runs);
// The bytes of `v` as a varint.
size_t varint_bytes(uint64_t v);

// Replaces `encoded` by one zstd frame of it at `level` when that saves at least an eighth of its
// bytes; returns whether it did (the piece then carries kDeltaZstd).
bool compress_delta(std::vector<uint8_t>& encoded, int level);

// Applies `encoded` (`encoding`, as encode_delta wrote it) onto `values`, n elements of `elem` bytes
// holding the old ones. DataLoss, and nothing written, when the encoding does not describe exactly
// n elements (a count, a run past the end, values too few or too many).
// `changed`, when given, receives the runs [first, first + count) of the elements it wrote (left as
// it was when the encoding is refused), each widened to whole units of `granularity` elements (a
// caller that needs only the rows a delta wrote in passes the elements of a row: a few runs per
// piece instead of one per changed run).
// `field`: a piece's encoding field, the encoding with its flags (a zstd frame must inflate to
// no more than any encoding of n elements can take).
Status apply_delta(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, uint8_t* values, size_t n, size_t elem,
                   std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr, uint64_t granularity = 1);
inline Status apply_delta(DeltaEncoding encoding, const uint8_t* encoded, size_t encoded_bytes, uint8_t* values,
                          size_t n, size_t elem, std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr,
                          uint64_t granularity = 1) {
  return apply_delta(static_cast<uint32_t>(encoding), encoded, encoded_bytes, values, n, elem, changed, granularity);
}

// A delta's changed elements as the bitmap of the n elements (bit i % 8 of byte i / 8 set when
// element i changed) and the new values (or XORs with the old) of the changed ones, in order.
struct DeltaBitmap {
  const uint8_t* bitmap = nullptr;  // ceil(n / 8) bytes: into the encoding, `inflated` or `built`
  const uint8_t* values = nullptr;  // changed * elem bytes: into the encoding or `inflated`
  uint64_t changed = 0;
  bool xor_values = false;
  std::vector<uint8_t> built;     // the bitmap of a runs encoding
  std::vector<uint8_t> inflated;  // a zstd frame's contents
};
// `encoded`'s changed elements as a bitmap and their values (DeltaBitmap), for a destination
// apply_delta cannot write (device memory): a bitmap encoding's own, a runs encoding's built; the
// same checks as apply_delta.
Status delta_bitmap(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem,
                    DeltaBitmap& out);

// A runs encoding's pairs and values for a decoder that checks the pairs itself (a device's,
// delta_device.h): the count read, the pairs' end found by counting the bytes that end varints.
struct DeltaRuns {
  const uint8_t* pairs = nullptr;  // r pairs of varints (unchecked)
  size_t pair_bytes = 0;
  uint64_t runs = 0;
  const uint8_t* values = nullptr;  // `changed` values (the bytes after the pairs, whole elements)
  uint64_t changed = 0;
  bool xor_values = false;
  std::vector<uint8_t> inflated;  // a zstd frame's contents
};
// DataLoss for an encoding that is not runs, or whose count, pairs' ends or values do not add up.
Status delta_runs(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem, DeltaRuns& out);

// How many elements `encoded` says changed; the same checks as apply_delta, nothing written.
Result<uint64_t> delta_changed(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem);
inline Result<uint64_t> delta_changed(DeltaEncoding encoding, const uint8_t* encoded, size_t encoded_bytes, size_t n,
                                      size_t elem) {
  return delta_changed(static_cast<uint32_t>(encoding), encoded, encoded_bytes, n, elem);
}

std::string_view encoding_name(DeltaEncoding encoding);

}  // namespace ferry::dataplane

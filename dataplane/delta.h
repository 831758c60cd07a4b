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
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/status.h"

namespace ferry::dataplane {

enum class DeltaEncoding : uint32_t { kDense = 0, kBitmap = 1, kRuns = 2 };

struct DeltaChoice {
  DeltaEncoding encoding = DeltaEncoding::kDense;
  uint64_t changed = 0;  // elements that differ
};

// Compares `n` elements of `elem` bytes of `before` and `after`, and writes into `out` the
// smallest of the delta encodings. kDense (and `out` empty) when the dense bytes are no larger,
// unless `prefer_delta` (FERRY_DELTA=always), which keeps the smaller delta encoding anyway.
DeltaChoice encode_delta(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool prefer_delta,
                         std::vector<uint8_t>& out);

// Applies `encoded` (`encoding`, as encode_delta wrote it) onto `values`, n elements of `elem` bytes
// holding the old ones. DataLoss, and nothing written, when the encoding does not describe exactly
// n elements (a count, a run past the end, values too few or too many).
// `changed`, when given, receives the runs [first, first + count) of the elements it wrote.
Status apply_delta(DeltaEncoding encoding, const uint8_t* encoded, size_t encoded_bytes, uint8_t* values, size_t n,
                   size_t elem, std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr);

// How many elements `encoded` says changed; the same checks as apply_delta, nothing written.
Result<uint64_t> delta_changed(DeltaEncoding encoding, const uint8_t* encoded, size_t encoded_bytes, size_t n,
                               size_t elem);

std::string_view encoding_name(DeltaEncoding encoding);

}  // namespace ferry::dataplane

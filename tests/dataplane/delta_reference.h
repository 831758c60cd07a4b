// References for the delta codec's tests (tests/dataplane/delta_test.cc, delta_threads_test.cc),
// written element by element from the format's definition (dataplane/delta.h), independent of the
// codec: random pieces with changes, their runs, and their runs encoding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace ferry::dataplane::delta_ref {

using Bytes = std::vector<uint8_t>;

// `n` elements of `elem` bytes, and a copy with `changed` of them (a random subset) altered.
inline std::pair<Bytes, Bytes> pair_with_changes(size_t n, size_t elem, size_t changed, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes before(n * elem);
  for (auto& b : before) b = static_cast<uint8_t>(rng());
  Bytes after = before;
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), rng);
  for (size_t k = 0; k < changed; ++k) {
    // Flip one byte of the element: it differs, however the others compare.
    after[idx[k] * elem + rng() % elem] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  return {before, after};
}

inline size_t count_changed(const Bytes& a, const Bytes& b, size_t elem) {
  size_t k = 0;
  for (size_t i = 0; i < a.size() / elem; ++i) k += std::memcmp(&a[i * elem], &b[i * elem], elem) != 0;
  return k;
}

// The runs an element-by-element scan finds, [first, first + length).
inline std::vector<std::pair<uint64_t, uint64_t>> reference_changed(const Bytes& before, const Bytes& after,
                                                                    size_t elem) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (size_t e = 0; e < before.size() / elem; ++e) {
    if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == e) {
      ++runs.back().second;
    } else {
      runs.emplace_back(e, 1);
    }
  }
  return runs;
}

// The runs encoding as the format defines it, from reference_changed(); with `xor_values`, each
// value new XOR old (kDeltaXor).
inline Bytes reference_runs(const Bytes& before, const Bytes& after, size_t elem, bool xor_values = false) {
  const auto runs = reference_changed(before, after, elem);
  Bytes out;
  const auto varint = [&out](uint64_t v) {
    for (; v >= 0x80; v >>= 7) out.push_back(static_cast<uint8_t>(v | 0x80));
    out.push_back(static_cast<uint8_t>(v));
  };
  varint(runs.size());
  uint64_t at = 0;
  for (const auto& [first, len] : runs) {
    varint(first - at);
    varint(len);
    at = first + len;
  }
  for (const auto& [first, len] : runs) {
    for (size_t b = first * elem; b < (first + len) * elem; ++b) {
      out.push_back(static_cast<uint8_t>(xor_values ? after[b] ^ before[b] : after[b]));
    }
  }
  return out;
}

}  // namespace ferry::dataplane::delta_ref

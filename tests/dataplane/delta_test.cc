// The delta codec (dataplane/delta.h): round trips at the change rates RL steps produce, the choice
// between encodings and dense bytes, and encodings off a wire that do not describe the piece.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "dataplane/delta.h"

namespace ferry::dataplane {
namespace {

using Bytes = std::vector<uint8_t>;

// `n` elements of `elem` bytes, and a copy with `changed` of them (a random subset) altered.
std::pair<Bytes, Bytes> pair_with_changes(size_t n, size_t elem, size_t changed, uint64_t seed) {
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

size_t count_changed(const Bytes& a, const Bytes& b, size_t elem) {
  size_t k = 0;
  for (size_t i = 0; i < a.size() / elem; ++i) k += std::memcmp(&a[i * elem], &b[i * elem], elem) != 0;
  return k;
}

TEST(Delta, RoundTripsAtEveryChangeRate) {
  for (size_t elem : {1, 2, 4}) {
    for (double rate : {0.0, 0.001, 0.03, 0.3, 1.0}) {
      const size_t n = 40'003;  // not a multiple of 8: the bitmap's last byte is partial
      auto [before, after] = pair_with_changes(n, elem, static_cast<size_t>(rate * n), 7 + elem);
      for (bool prefer : {false, true}) {
        Bytes enc;
        const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, prefer, enc);
        EXPECT_EQ(c.changed, count_changed(before, after, elem)) << elem << " " << rate;
        if (c.encoding == DeltaEncoding::kDense) {
          EXPECT_FALSE(prefer);
          EXPECT_TRUE(enc.empty());
          EXPECT_GE(rate, 0.3) << "a sparse change went dense";
          continue;
        }
        EXPECT_LT(enc.size(), prefer ? n * elem + n / 8 + 16 : n * elem);
        Bytes got = before;
        Status st = apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem);
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(got, after) << "elem " << elem << " rate " << rate << " " << encoding_name(c.encoding);
        auto k = delta_changed(c.encoding, enc.data(), enc.size(), n, elem);
        ASSERT_TRUE(k.ok());
        EXPECT_EQ(*k, c.changed);
      }
    }
  }
}

TEST(Delta, PicksTheSmallerEncoding) {
  const size_t n = 8192, elem = 2;
  // A few scattered changes: runs are smaller than a bitmap of every element.
  auto [b1, a1] = pair_with_changes(n, elem, 10, 1);
  Bytes enc;
  EXPECT_EQ(encode_delta(b1.data(), a1.data(), n, elem, false, enc).encoding, DeltaEncoding::kRuns);
  EXPECT_LT(enc.size(), 10 * (elem + 6) + 4);
  // Every other element changed: a run per element costs more than one bit each.
  Bytes b2(n * elem, 0), a2 = b2;
  for (size_t i = 0; i < n; i += 2) a2[i * elem] = 1;
  EXPECT_EQ(encode_delta(b2.data(), a2.data(), n, elem, false, enc).encoding, DeltaEncoding::kBitmap);
  EXPECT_EQ(enc.size(), n / 8 + (n / 2) * elem);
  // Nothing changed: a count of zero runs.
  EXPECT_EQ(encode_delta(b2.data(), b2.data(), n, elem, false, enc).encoding, DeltaEncoding::kRuns);
  EXPECT_EQ(enc.size(), 1u);
  // Everything changed: dense, unless a delta is preferred.
  Bytes a3 = b2;
  for (size_t i = 0; i < n; ++i) a3[i * elem + 1] = 7;
  EXPECT_EQ(encode_delta(b2.data(), a3.data(), n, elem, false, enc).encoding, DeltaEncoding::kDense);
  EXPECT_NE(encode_delta(b2.data(), a3.data(), n, elem, true, enc).encoding, DeltaEncoding::kDense);
}

// The runs encoding as the format defines it, from a plain element-by-element scan.
Bytes reference_runs(const Bytes& before, const Bytes& after, size_t elem) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  const size_t n = before.size() / elem;
  for (size_t e = 0; e < n; ++e) {
    if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == e) {
      ++runs.back().second;
    } else {
      runs.emplace_back(e, 1);
    }
  }
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
  for (const auto& [first, len] : runs) out.insert(out.end(), after.data() + first * elem, after.data() + (first + len) * elem);
  return out;
}

// A piece large enough to be compared by several threads: runs that cross the threads' slices
// come out whole, and the encoding is the one an element-by-element scan gives.
TEST(Delta, LargePiecesEncodeAsOneScanWould) {
  const size_t n = size_t{9} << 20, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, n / 1000, 21);
  // Runs across every multiple of 1 Mi elements, whatever the slices are.
  for (size_t b = size_t{1} << 20; b < n; b += size_t{1} << 20) {
    for (size_t e = b - 5; e < b + 5; ++e) after[e * elem] ^= 0x10;
  }
  Bytes enc;
  const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, false, enc);
  ASSERT_EQ(c.encoding, DeltaEncoding::kRuns);
  EXPECT_TRUE(enc == reference_runs(before, after, elem)) << "encoded " << enc.size() << " bytes";
  Bytes got = before;
  ASSERT_TRUE(apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem).ok());
  EXPECT_TRUE(got == after);
}

// Every malformed encoding is refused with DataLoss, and the values stay as they were.
TEST(Delta, RefusesEncodingsThatDoNotDescribeThePiece) {
  const size_t n = 100, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, 30, 3);
  Bytes runs, bitmap;
  ASSERT_EQ(encode_delta(before.data(), after.data(), n, elem, true, runs).encoding, DeltaEncoding::kBitmap);
  bitmap = runs;
  auto [b2, a2] = pair_with_changes(n, elem, 3, 4);
  ASSERT_EQ(encode_delta(b2.data(), a2.data(), n, elem, false, runs).encoding, DeltaEncoding::kRuns);

  struct Bad {
    const char* what;
    DeltaEncoding e;
    Bytes enc;
  };
  std::vector<Bad> cases;
  cases.push_back({"bitmap truncated", DeltaEncoding::kBitmap, Bytes(bitmap.begin(), bitmap.begin() + 5)});
  Bytes extra = bitmap;
  extra.push_back(0);
  cases.push_back({"a value too many", DeltaEncoding::kBitmap, extra});
  Bytes past = bitmap;
  past[n / 8] |= 0x80;  // bit 103 of 100 elements
  cases.push_back({"bit past the end", DeltaEncoding::kBitmap, past});
  cases.push_back({"runs truncated", DeltaEncoding::kRuns, Bytes(runs.begin(), runs.end() - 1)});
  cases.push_back({"run past the end", DeltaEncoding::kRuns, Bytes{1, 99, 5, 0, 0, 0, 0, 0, 0, 0, 0}});
  cases.push_back({"empty run", DeltaEncoding::kRuns, Bytes{1, 0, 0}});
  cases.push_back({"huge run count", DeltaEncoding::kRuns, Bytes{0xff, 0xff, 0xff, 0xff, 0x0f}});
  cases.push_back({"overlong varint", DeltaEncoding::kRuns, Bytes(12, 0x80)});
  cases.push_back({"unknown encoding", static_cast<DeltaEncoding>(9), runs});
  cases.push_back({"empty", DeltaEncoding::kRuns, Bytes{}});
  for (const Bad& c : cases) {
    Bytes values = before;
    Status st = apply_delta(c.e, c.enc.data(), c.enc.size(), values.data(), n, elem);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << c.what << ": " << st.to_string();
    EXPECT_EQ(values, before) << c.what << " wrote values";
  }
}

}  // namespace
}  // namespace ferry::dataplane

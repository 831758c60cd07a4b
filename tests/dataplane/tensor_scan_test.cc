// A tensor's boxes compared together (dataplane/tensor_scan.h): every part of every box encodes to
// the bytes encode_delta() gives that part's elements packed by the test and compared alone, and the
// kept copy comes out as the new tensor exactly when the boxes tile it, untouched otherwise; on
// every compare this CPU has, and every slicing from 1 to 8 threads.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/parallel.h"
#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"
#include "dataplane/tensor_scan.h"

namespace ferry::dataplane {
namespace {

using Bytes = std::vector<uint8_t>;

struct WithThreads {
  explicit WithThreads(size_t threads) : was(host_threads()) { set_host_threads(threads); }
  ~WithThreads() { set_host_threads(was); }
  size_t was;
};

// Box `r` of a row-major tensor of `shape` with `elem`-byte elements, element by element.
Bytes pack(const Bytes& t, const Shape& shape, const Region& r, size_t elem) {
  Bytes out;
  const size_t rank = shape.size();
  std::vector<int64_t> idx(rank, 0);
  const int64_t n = r.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t flat = 0;
    for (size_t d = 0; d < rank; ++d) flat = flat * shape[d] + r.offset[d] + idx[d];
    out.insert(out.end(), t.begin() + flat * static_cast<int64_t>(elem),
               t.begin() + (flat + 1) * static_cast<int64_t>(elem));
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < r.size[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

struct Case {
  std::string name;
  Shape shape;
  std::vector<Region> boxes;
  bool tiles;          // the distinct boxes tile the tensor
  bool large = false;  // compared in the slicing test only (the reference packs element by element)
};

// Whether a box is compared where it lies, as tensor_scan.h says: rows along the first dimension
// whose rows are one run of the tensor or whole groups of 8 elements.
bool in_place(const Shape& shape, const Region& b) {
  if (shape.size() < 2 || b.size[0] <= 1) return true;
  int64_t inner = 1;
  for (size_t d = 2; d < shape.size(); ++d) inner *= shape[d];
  return b.size[1] == shape[1] || b.size[1] * inner % 8 == 0;
}

Region box(Dims offset, Dims size) { return Region{std::move(offset), std::move(size)}; }

std::vector<Case> cases() {
  return {
      {"column boxes (a row-parallel weight at TP 2)", {40, 96}, {box({0, 0}, {40, 48}), box({0, 48}, {40, 48})}, true},
      {"column boxes of three dimensions", {6, 16, 3}, {box({0, 0, 0}, {6, 8, 3}), box({0, 8, 0}, {6, 8, 3})}, true},
      {"row boxes of 5-element rows", {1000, 5}, {box({0, 0}, {333, 5}), box({333, 0}, {667, 5})}, true},
      {"row boxes of many slices", {2048, 512}, {box({0, 0}, {1024, 512}), box({1024, 0}, {1024, 512})}, true, true},
      {"a replicated tensor, the same box twice", {300, 7}, {box({0, 0}, {300, 7}), box({0, 0}, {300, 7})}, true},
      {"overlapping boxes", {64, 64}, {box({0, 0}, {40, 64}), box({20, 0}, {44, 64})}, false},
      {"one box of two", {64, 64}, {box({0, 0}, {64, 32})}, false},
      {"columns of 6 elements: compared alone", {20, 12}, {box({0, 0}, {20, 6}), box({0, 6}, {20, 6})}, true},
      {"columns of 32, 6 and 26: the first compared, the others alone",
       {64, 64},
       {box({0, 0}, {64, 32}), box({0, 32}, {64, 6}), box({0, 38}, {64, 26})},
       true},
      {"a vector in two", {1001}, {box({0}, {500}), box({500}, {501})}, true},
      {"a scalar", {}, {box({}, {})}, true},
      // Slices that begin inside a row of a column box, and rows longer than one compare call.
      {"column boxes of many slices", {1024, 1024}, {box({0, 0}, {1024, 512}), box({0, 512}, {1024, 512})}, true, true},
      {"column boxes of long rows", {16, 16384}, {box({0, 0}, {16, 8192}), box({0, 8192}, {16, 8192})}, true, true},
  };
}

// Parts of `b` as buckets would take them: the whole box, then its rows in runs of 1, 3, 7, ...
std::vector<Region> parts_of(const Region& b) {
  std::vector<Region> parts{b};
  if (b.rank() == 0) return parts;
  int64_t step = 1;
  for (int64_t row = 0; row < b.size[0]; step = step * 2 + 1) {
    Region p = b;
    p.offset[0] = b.offset[0] + row;
    p.size[0] = std::min(step, b.size[0] - row);
    parts.push_back(p);
    row += p.size[0];
  }
  return parts;
}

void check(const Case& c, size_t elem, double rate, bool xor_values, bool keep, uint64_t seed) {
  const DType dtype = elem == 1 ? DType::kU8 : elem == 2 ? DType::kBF16 : elem == 4 ? DType::kF32 : DType::kI64;
  const size_t n = static_cast<size_t>(shape_numel(c.shape));
  std::mt19937_64 rng(seed);
  Bytes old(n * elem), now;
  for (auto& b : old) b = static_cast<uint8_t>(rng());
  now = old;
  std::bernoulli_distribution changes(rate);
  for (size_t i = 0; i < n; ++i) {
    if (changes(rng)) now[i * elem + rng() % elem] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  const Bytes was = old;
  const std::string what =
      fmt::format("{}, {}-byte elements, {} changed, xor {}, keep {}", c.name, elem, rate, xor_values, keep);
  TensorScan scan;
  const bool kept = scan.compare(TensorView(now.data(), dtype, c.shape), old.data(), c.boxes, xor_values, keep, 41);
  bool every = true;
  for (const Region& b : c.boxes) every = every && in_place(c.shape, b);
  EXPECT_EQ(kept, keep && c.tiles && every) << what;
  EXPECT_EQ(scan.version(), 41u);
  if (kept) {
    EXPECT_EQ(old, now) << what << ": the kept copy is the new tensor";
  } else {
    EXPECT_EQ(old, was) << what << ": the kept copy is left as it was";
  }
  for (const Region& b : c.boxes) {
    for (const Region& p : parts_of(b)) {
      ASSERT_EQ(scan.covers(p), in_place(c.shape, b)) << what << ", part " << p.to_string();
      if (!in_place(c.shape, b)) continue;
      const Bytes before = pack(was, c.shape, p, elem), after = pack(now, c.shape, p, elem);
      std::vector<uint8_t> want, got;
      const DeltaChoice a =
          encode_delta(before.data(), after.data(), before.size() / elem, elem, false, want, xor_values);
      const DeltaChoice g = scan.encode(p, false, got);
      EXPECT_EQ(g.encoding, a.encoding) << what << ", part " << p.to_string();
      EXPECT_EQ(g.changed, a.changed) << what << ", part " << p.to_string();
      EXPECT_EQ(got, want) << what << ", part " << p.to_string();
      // Preferred over dense bytes, too (every element changed still has an encoding).
      encode_delta(before.data(), after.data(), before.size() / elem, elem, true, want, xor_values);
      scan.encode(p, true, got);
      EXPECT_EQ(got, want) << what << ", part " << p.to_string() << ", delta preferred";
    }
  }
}

TEST(TensorScan, EveryPartEncodesAsItsElementsComparedAloneAndTheCopyIsKeptOnlyWhereBoxesTile) {
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    if (c.large) continue;
    for (const size_t elem : {1, 2, 4, 8}) {
      for (const double rate : {0.0, 0.001, 0.03, 1.0}) {
        for (const bool keep : {false, true}) check(c, elem, rate, /*xor_values=*/rate == 0.03, keep, seed++);
      }
    }
  }
}

TEST(TensorScan, EverySlicingAndCompareGivesTheSameParts) {
  const auto all = cases();
  for (const detail::ScanKind kind : detail::scans_available()) {
    const detail::ScanKind was = detail::use_scan(kind);
    for (const size_t threads : {1, 2, 3, 8}) {
      WithThreads t(threads);
      for (const Case& c : all) {
        if (!c.large) continue;
        check(c, 2, 0.03, false, true, 100 + threads);
        check(c, 1, 0.5, true, true, 200 + threads);
      }
      check(all[0], 2, 0.03, false, true, 300 + threads);
      check(all[2], 4, 0.03, false, true, 400 + threads);
    }
    detail::use_scan(was);
  }
}

TEST(TensorScan, AScanCoversOnlyWholeRowsOfItsBoxes) {
  Bytes t(64 * 64 * 2, 0);
  TensorScan scan;
  scan.compare(TensorView(t.data(), DType::kBF16, {64, 64}), Bytes(t).data(), {box({0, 0}, {64, 32})}, false, false, 3);
  EXPECT_TRUE(scan.covers(box({5, 0}, {10, 32})));
  EXPECT_FALSE(scan.covers(box({5, 0}, {10, 16}))) << "part of a row";
  EXPECT_FALSE(scan.covers(box({0, 32}, {64, 32}))) << "another box";
  EXPECT_FALSE(scan.covers(box({60, 0}, {10, 32}))) << "rows past the box";
  scan.clear();
  EXPECT_FALSE(scan.covers(box({0, 0}, {64, 32}))) << "cleared";
}

}  // namespace
}  // namespace ferry::dataplane

// Dims: the inline-or-heap values of a region, checked against std::vector doing the same steps
// (run under ASan: every move, copy and growth across the inline limit).
#include "core/dims.h"

#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace ferry {
namespace {

void expect_same(const Dims& d, const std::vector<int64_t>& v) {
  ASSERT_EQ(d.size(), v.size());
  EXPECT_EQ(std::vector<int64_t>(d), v);
  EXPECT_TRUE(d == v);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(d[i], v[i]);
}

TEST(Dims, GrowsPastTheInlineValuesAndBack) {
  Dims d;
  std::vector<int64_t> v;
  EXPECT_TRUE(d.empty());
  for (int64_t i = 0; i < 11; ++i) {
    d.push_back(i * 7 - 3);
    v.push_back(i * 7 - 3);
    expect_same(d, v);
  }
  d.assign(size_t{2}, 9);
  expect_same(d, {9, 9});
  d.resize(6, -1);
  expect_same(d, {9, 9, -1, -1, -1, -1});
  d.pop_back();
  expect_same(d, {9, 9, -1, -1, -1});
  d.clear();
  expect_same(d, {});
}

TEST(Dims, CopiesAndMovesBetweenInlineAndHeap) {
  for (size_t a = 0; a <= 2 * Dims::kInline; ++a) {
    for (size_t b = 0; b <= 2 * Dims::kInline; ++b) {
      std::vector<int64_t> va(a), vb(b);
      for (size_t i = 0; i < a; ++i) va[i] = static_cast<int64_t>(100 + i);
      for (size_t i = 0; i < b; ++i) vb[i] = static_cast<int64_t>(200 + i);
      Dims x(va), y(vb);
      Dims copy = x;
      expect_same(copy, va);
      copy = y;  // copy-assign over either storage
      expect_same(copy, vb);
      Dims moved = std::move(copy);
      expect_same(moved, vb);
      EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from Dims is empty
      moved = std::move(x);        // move-assign over either storage
      expect_same(moved, va);
      copy = moved;  // a moved-from Dims takes values again
      expect_same(copy, va);
      const Dims& same = copy;
      copy = same;  // assigning a Dims to itself
      expect_same(copy, va);
      EXPECT_EQ(Dims(va) == Dims(vb), va == vb);
      EXPECT_EQ(Dims(va) < Dims(vb), va < vb);
    }
  }
}

TEST(Dims, MatchesAVectorOverRandomSteps) {
  std::mt19937 rng(7);
  std::vector<Dims> ds(4);
  std::vector<std::vector<int64_t>> vs(4);
  for (int step = 0; step < 4000; ++step) {
    const size_t i = rng() % 4, j = rng() % 4;
    switch (rng() % 6) {
      case 0: ds[i].push_back(step), vs[i].push_back(step); break;
      case 1: ds[i] = ds[j], vs[i] = vs[j]; break;
      case 2:
        if (i != j) ds[i] = std::move(ds[j]), vs[i] = std::move(vs[j]), vs[j].clear();
        break;
      case 3: ds[i].resize(rng() % 9, step), vs[i].resize(ds[i].size(), step); break;
      case 4: ds[i].clear(), vs[i].clear(); break;
      default: ds[i] = Dims(vs[j].begin(), vs[j].end()), vs[i] = vs[j]; break;
    }
    expect_same(ds[i], vs[i]);
    expect_same(ds[j], vs[j]);
  }
}

}  // namespace
}  // namespace ferry

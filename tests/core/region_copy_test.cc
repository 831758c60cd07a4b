// Host region copies (core/region_copy.h) against a plain element loop: boxes small enough for one
// pass, and large ones shared out across threads (a single run of whole rows, and many runs of a
// rank's columns), packed and unpacked, byte for byte; copy_parallel (core/parallel.h) likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "core/region_copy.h"
#include "core/tensor.h"

namespace ferry {
namespace {

using Bytes = std::vector<uint8_t>;

// The box [r0, r0 + rows) x [c0, c0 + cols) of a rows_all x cols_all matrix of `elem`-byte elements,
// element by element.
Bytes reference_pack(const Bytes& m, int64_t cols_all, size_t elem, int64_t r0, int64_t rows, int64_t c0,
                     int64_t cols) {
  Bytes out;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t c = c0; c < c0 + cols; ++c) {
      for (size_t b = 0; b < elem; ++b) out.push_back(m[(static_cast<size_t>(r * cols_all + c)) * elem + b]);
    }
  }
  return out;
}

// The copies spread over `threads` (FERRY_THREADS) while it lives, whatever this machine's cores.
struct ThreadsFor {
  explicit ThreadsFor(size_t threads) : was(host_threads()) { set_host_threads(threads); }
  ~ThreadsFor() { set_host_threads(was); }
  size_t was;
};

TEST(RegionCopy, LargeBoxesCopiedOnSeveralThreadsAsOnePassWould) {
  std::mt19937_64 rng(5);
  const int64_t rows_all = 4096, cols_all = 8192;  // 64 MiB of bf16
  Bytes m(static_cast<size_t>(rows_all * cols_all) * 2);
  for (auto& b : m) b = static_cast<uint8_t>(rng());
  TensorView t(m.data(), DType::kBF16, {rows_all, cols_all});
  struct Box {
    const char* what;
    int64_t r0, rows, c0, cols;
  };
  // On 1 to 8 threads (FERRY_THREADS), whatever this machine's cores: every slicing.
  for (size_t threads : {size_t{1}, size_t{2}, size_t{3}, size_t{8}}) {
    const ThreadsFor spread(threads);
    SCOPED_TRACE(std::to_string(threads) + " threads");
    for (const Box& b :
         {Box{"small, one pass", 3, 5, 7, 11}, Box{"whole rows: one large run", 1000, 2500, 0, 8192},
          Box{"a rank's columns: many runs", 0, 4096, 4096, 4096}, Box{"odd columns and rows", 17, 4001, 1001, 5003},
          Box{"2.75 MiB of columns: slices of 1 MiB", 0, 1024, 4096, 1408}}) {
      SCOPED_TRACE(b.what);
      const Region region{{b.r0, b.c0}, {b.rows, b.cols}};
      const Bytes want = reference_pack(m, cols_all, 2, b.r0, b.rows, b.c0, b.cols);
      Bytes got(want.size());
      ASSERT_TRUE(pack_region(t, region, got.data(), got.size()).ok());
      EXPECT_TRUE(got == want);
      // Unpacked into a copy whose box was scrambled: the matrix again, nothing outside the box touched.
      Bytes copy = m;
      TensorView u(copy.data(), DType::kBF16, {rows_all, cols_all});
      for (int64_t r = b.r0; r < b.r0 + b.rows; ++r) {
        std::memset(&copy[static_cast<size_t>(r * cols_all + b.c0) * 2], 0x5a, static_cast<size_t>(b.cols) * 2);
      }
      ASSERT_TRUE(unpack_region(u, region, got.data(), got.size()).ok());
      EXPECT_TRUE(copy == m);
    }
  }
}

TEST(RegionCopy, CopyParallelCopiesEveryByte) {
  for (size_t threads : {size_t{2}, size_t{8}}) {
    const ThreadsFor spread(threads);
    for (size_t bytes : {size_t{0}, size_t{1}, (size_t{3} << 20) + 7, size_t{40} << 20, (size_t{100} << 20) + 13}) {
      Bytes src(bytes), dst(bytes + 2, 0xee);
      for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
      copy_parallel(dst.data() + 1, src.data(), bytes);
      EXPECT_EQ(dst.front(), 0xee);
      EXPECT_EQ(dst.back(), 0xee);
      EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 1)) << bytes << " bytes, " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace ferry

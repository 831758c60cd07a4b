// ucx's receive buffers (transport/ucx/ucx_buffer_pool.h): a rank holds delivered buckets until
// their layers are complete, so with several senders many are out at once; the next update's
// buckets must land in the same blocks, not in fresh pages for UCX to fault in. Part of the
// conformance suite's binary; built only with ucx.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "transport/ucx/ucx_buffer_pool.h"

namespace ferry::transport::ucx {
namespace {

constexpr size_t kBucket = size_t{1} << 20;

std::vector<std::unique_ptr<BufferPool::Block>> take(BufferPool& pool, size_t n) {
  std::vector<std::unique_ptr<BufferPool::Block>> out;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(pool.take(kBucket - i));  // a little smaller each: any kept block serves
    EXPECT_NE(out.back(), nullptr);
  }
  return out;
}

TEST(UcxBufferPool, AsManyBlocksAsWereOutAtOnceAreReused) {
  BufferPool pool(nullptr);  // unmapped, as the same-host lanes' pool
  for (const size_t out : {6u, 12u}) {
    for (int round = 0; round < 3; ++round) {
      auto blocks = take(pool, out);
      for (auto& b : blocks) pool.give(std::move(b));
      EXPECT_EQ(pool.allocations(), out) << out << " blocks out at once, round " << round
                                         << ": each round's buckets land in the blocks of the first";
    }
  }
}

}  // namespace
}  // namespace ferry::transport::ucx

// The work pool runs every piece of a job exactly once and returns only when all are done: from
// several threads at once, with jobs started inside pieces, and with more pieces than workers.
#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/work_pool.h"

namespace ferry {
namespace {

TEST(WorkPool, EveryPieceRunsOnceBeforeTheJobReturns) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{64}}) {
    std::vector<std::atomic<int>> ran(count);
    run_pieces(count, [&](size_t t) { ran[t].fetch_add(1); });
    for (size_t t = 0; t < count; ++t) EXPECT_EQ(ran[t].load(), 1) << "piece " << t << " of " << count;
  }
}

// Callers on several threads share the workers; pieces start jobs of their own (a kernel inside a
// piece of another): each caller takes back what no worker took, so nothing waits forever.
TEST(WorkPool, ConcurrentAndNestedJobsAllFinish) {
  constexpr int kCallers = 4, kJobs = 50;
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&] {
      for (int j = 0; j < kJobs; ++j) {
        run_pieces(4, [&](size_t) { run_pieces(3, [&](size_t t) { sum.fetch_add(static_cast<long>(t) + 1); }); });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), static_cast<long>(kCallers) * kJobs * 4 * (1 + 2 + 3));
}

// A piece's writes are seen by the caller once run_pieces returns.
TEST(WorkPool, WritesOfPiecesAreVisibleAfterTheJob) {
  std::vector<int> out(1000, 0);
  for (int round = 1; round <= 20; ++round) {
    run_pieces(10, [&](size_t t) {
      for (size_t i = t * 100; i < (t + 1) * 100; ++i) out[i] = round;
    });
    for (int v : out) ASSERT_EQ(v, round);
  }
}

}  // namespace
}  // namespace ferry

// examples/async_rl run briefly over real sockets: every token carries a version the trainer
// published and the storage held when it was generated, versions only grow on each replica, no
// token is generated between a pause and its resume, and generation spans at least 3 versions.
#include <gtest/gtest.h>

#include <set>

#include "examples/async_rl/async_rl.h"

namespace async_rl {
namespace {

void check(const RunLog& log, const Options& o) {
  ASSERT_EQ(log.published.size(), static_cast<size_t>(o.updates) + 1);
  const std::set<uint64_t> published(log.published.begin(), log.published.end());
  ASSERT_EQ(log.replicas.size(), static_cast<size_t>(o.replicas));
  for (size_t r = 0; r < log.replicas.size(); ++r) {
    uint64_t last_version = 0, last_seq = 0, tokens = 0;
    bool paused = false;
    int pauses = 0, resumes = 0;
    std::set<uint64_t> seen;
    for (const Event& e : log.replicas[r]) {
      EXPECT_GE(e.seq, last_seq) << "replica " << r << ": events out of order";
      last_seq = e.seq;
      if (e.kind == Event::kPause) {
        EXPECT_FALSE(paused) << "replica " << r << ": paused twice";
        paused = true;
        ++pauses;
      } else if (e.kind == Event::kResume) {
        EXPECT_TRUE(paused) << "replica " << r << ": resumed without a pause";
        EXPECT_TRUE(published.count(e.version)) << "replica " << r << ": resumed at unpublished v" << e.version;
        paused = false;
        ++resumes;
      } else {
        ++tokens;
        EXPECT_FALSE(paused) << "replica " << r << ": token generated while paused (seq " << e.seq << ")";
        EXPECT_TRUE(published.count(e.version)) << "replica " << r << ": token tagged v" << e.version;
        EXPECT_GE(e.version, last_version) << "replica " << r << ": version went back";
        EXPECT_EQ(e.version, e.hook_version) << "replica " << r << ": tag differs from the version resumed with";
        last_version = e.version;
        seen.insert(e.version);
      }
    }
    EXPECT_EQ(pauses, static_cast<int>(log.published.size())) << "replica " << r;
    EXPECT_EQ(resumes, pauses) << "replica " << r;
    EXPECT_GE(seen.size(), 3u) << "replica " << r;
    EXPECT_GE(tokens, log.published.size() * static_cast<uint64_t>(o.steps_per_update * o.tokens_per_step));
  }
  ASSERT_EQ(log.updates.size(), log.published.size());
  for (const UpdateStats& u : log.updates) {
    EXPECT_GT(u.seconds, 0.0);
    ASSERT_EQ(u.frozen_seconds.size(), static_cast<size_t>(o.replicas));
  }
}

TEST(AsyncRl, KeepPausesFreezeGenerationAndTokensCarryTheirVersion) {
  Options o;
  o.replicas = 2;
  o.updates = 3;
  o.steps_per_update = 2;
  o.tokens_per_step = 4;
  auto log = run(o);
  ASSERT_TRUE(log.ok()) << log.status().to_string();
  check(*log, o);
  print_summary(*log);
}

TEST(AsyncRl, ClearCacheRestartsSequencesAndKeepsTheInvariants) {
  Options o;
  o.replicas = 1;
  o.updates = 2;
  o.clear_cache = true;
  auto log = run(o);
  ASSERT_TRUE(log.ok()) << log.status().to_string();
  check(*log, o);
}

}  // namespace
}  // namespace async_rl

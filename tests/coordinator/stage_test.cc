// Stage while serving (UpdateOptions::stage): a trainer and a TP replica over real tcp sockets, each
// rank with a serving loop that answers requests whenever its engine is not paused. While the
// update's buckets are on their way the loops keep answering and no pause hook has run; the ranks
// pause once, to apply, and storage then holds the new version byte for byte (scheme_bytes.h). A
// staging bound too small for a rank's input makes the update pause first, with a warning that
// names the bound. An update that fails while staging leaves the replica serving its old version.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/log.h"
#include "dataplane/bucket_sender.h"
#include "tests/common/scoped_env.h"
#include "tests/common/warnings.h"
#include "tests/coordinator/scheme_bytes.h"

namespace ferry::testutil {
namespace {

using Clock = std::chrono::steady_clock;

// Per rank, a loop that answers a request whenever the rank is not inside its pause hook's window.
class Serving {
 public:
  explicit Serving(Cluster& c) : c_(c), served_(static_cast<size_t>(c.tp())) {
    for (int r = 0; r < c.tp(); ++r) {
      threads_.emplace_back([this, r] {
        Rank& rank = c_.rank(r);
        while (!stop_) {
          if (rank.pauses.load() == rank.resumes.load()) served_[static_cast<size_t>(r)]++;
          std::this_thread::yield();
        }
      });
    }
  }
  ~Serving() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  uint64_t served(int r) const { return served_[static_cast<size_t>(r)].load(); }
  // True once every rank answered `more` requests after this call, within five seconds.
  bool answers(uint64_t more) const {
    std::vector<uint64_t> from;
    for (int r = 0; r < c_.tp(); ++r) from.push_back(served(r));
    const auto until = Clock::now() + std::chrono::seconds(5);
    for (int r = 0; r < c_.tp(); ++r) {
      while (served(r) < from[static_cast<size_t>(r)] + more) {
        if (Clock::now() > until) return false;
        std::this_thread::yield();
      }
    }
    return true;
  }

 private:
  Cluster& c_;
  std::vector<std::atomic<uint64_t>> served_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

int total_pauses(Cluster& c) {
  int n = 0;
  for (int r = 0; r < c.tp(); ++r) n += c.rank(r).pauses.load();
  return n;
}

struct BucketWatch {
  std::mutex mu;
  int buckets = 0;
  int paused_during = 0;  // buckets sealed while some rank had paused for this update
  bool served_during = true;  // staged: every rank answered requests while each bucket was sealed
};

class StageTest : public ::testing::Test {
 protected:
  void TearDown() override {
    dataplane::set_sealed_bucket_hook_for_testing({});
    caught_.reset();
  }

  // Warnings logged from now on (kept by the fixture: it outlives every thread that logs).
  void catch_warnings() { caught_ = std::make_unique<CaughtWarnings>(); }
  bool warned(const std::string& a, const std::string& b) const { return caught_ && caught_->count(a, b) > 0; }

  std::unique_ptr<CaughtWarnings> caught_;

  // Runs update `v` of `ck` (UpdateOptions::stage = `stage`), watching every bucket as it is
  // sealed: whether the ranks had paused for it by then, and, where `serving` (the update is
  // expected to stage), whether they keep answering requests while it is on its way.
  Result<coordinator::UpdateReport> watched_update(Cluster& c, Serving& serving, BucketWatch& w, uint64_t v,
                                                   const Checkpoint& ck, bool stage, bool serves) {
    const int before = total_pauses(c);
    dataplane::set_sealed_bucket_hook_for_testing([&](int, int, uint8_t*, size_t) {
      std::lock_guard<std::mutex> lock(w.mu);
      ++w.buckets;
      if (total_pauses(c) > before) ++w.paused_during;
      // (Pause-first ranks answer nothing until the update ends: not waited for.)
      if (serves && !serving.answers(20)) w.served_during = false;
      return ok_status();
    });
    coordinator::UpdateOptions o;
    o.stage = stage;
    FERRY_RETURN_IF_ERROR(c.trainer().start_weight_update(v, c.manifest(), o));
    coordinator::MapSource src(ck.views);
    FERRY_RETURN_IF_ERROR(c.trainer().update_weights(src));
    auto r = c.trainer().finish_weight_update();
    dataplane::set_sealed_bucket_hook_for_testing({});
    return r;
  }
};

TEST_F(StageTest, RanksServeWhileTheBytesArriveAndPauseOnlyToApply) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv buckets("FERRY_BUCKET_BYTES", "64K");  // many buckets per rank
  const Config cfg = several_buckets();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 1);
  ASSERT_TRUE(c.update(1, ck).ok());
  Serving serving(c);

  // Without staging the ranks pause before the first byte moves: no request is answered meanwhile.
  ck = make_checkpoint(c.manifest(), 2);
  BucketWatch dense;
  auto r = watched_update(c, serving, dense, 2, ck, false, false);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->staged);
  EXPECT_EQ(dense.paused_during, dense.buckets) << "pause-first: every bucket moves while the ranks are paused";
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), "v2 pause first");

  ck = make_checkpoint(c.manifest(), 3);
  BucketWatch staged;
  const int pauses = total_pauses(c);
  r = watched_update(c, serving, staged, 3, ck, true, true);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->staged);
  EXPECT_GT(staged.buckets, 4);
  EXPECT_EQ(staged.paused_during, 0) << "no rank paused while bytes were on their way";
  EXPECT_TRUE(staged.served_during) << "every rank answered requests while each bucket was on its way";
  EXPECT_EQ(total_pauses(c), pauses + c.tp()) << "each rank paused once, to apply";
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_EQ(c.rank(i).worker->weight_version(), 3u);
    EXPECT_EQ(c.rank(i).last_resume.load(), 3u);
  }
  EXPECT_GT(r->pause_window_seconds, 0.0);
  EXPECT_LT(r->pause_window_seconds, r->seconds);
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), "v3 staged");
}

TEST_F(StageTest, AStagingBoundTooSmallPausesFirstWithAWarningNamingIt) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv bound("FERRY_MAX_STAGING_BYTES", "300K");  // more than a layer, less than a rank's input
  const Config cfg = several_buckets();
  const Layout layout = make_layout(cfg, "int8_per_channel");
  Cluster c(cfg.tp, "int8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  catch_warnings();
  ASSERT_TRUE(c.update(1, make_checkpoint(c.manifest(), 1)).ok());  // the ranks serve v1
  Checkpoint ck = make_checkpoint(c.manifest(), 2);
  coordinator::UpdateOptions o;
  o.stage = true;
  ASSERT_TRUE(c.trainer().start_weight_update(2, c.manifest(), o).ok());
  coordinator::MapSource src(ck.views);
  ASSERT_TRUE(c.trainer().update_weights(src).ok());
  auto r = c.trainer().finish_weight_update();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->staged);
  EXPECT_TRUE(warned("FERRY_MAX_STAGING_BYTES=307200", "pauses first")) << "no warning names the bound";
  expect_storage(c, expected_storage(cfg, layout, Scheme::kInt8PerChannel, ck), "v2 fell back");
}

// FERRY_STAGE=on, read by the trainer when it is made, stages every update without the option:
// no rank pauses while the bytes move.
TEST_F(StageTest, FerryStageOnStagesUpdatesThatDoNotAskForIt) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv stage("FERRY_STAGE", "on");
  const Config cfg = several_buckets();
  const Layout layout = make_layout(cfg, "fp8_block");
  Cluster c(cfg.tp, "fp8_block", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  ASSERT_TRUE(c.update(1, make_checkpoint(c.manifest(), 1)).ok());
  Serving serving(c);
  const Checkpoint ck = make_checkpoint(c.manifest(), 2);
  BucketWatch w;
  const int pauses = total_pauses(c);
  auto r = watched_update(c, serving, w, 2, ck, false, true);  // UpdateOptions::stage left false
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->staged);
  EXPECT_GT(w.buckets, 0);
  EXPECT_EQ(w.paused_during, 0) << "a rank paused while bytes were on their way";
  EXPECT_TRUE(w.served_during) << "every rank answered requests while each bucket was on its way";
  EXPECT_EQ(total_pauses(c), pauses + c.tp()) << "each rank paused once, to apply";
  EXPECT_LT(r->pause_window_seconds, r->seconds);
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8Block, ck), "v2 staged by the setting");
}

TEST_F(StageTest, AnUpdateThatFailsWhileStagingLeavesTheReplicaServingItsVersion) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  const Config cfg = kv_above_tp();
  const Layout layout = make_layout(cfg, "fp8_block");
  Cluster c(cfg.tp, "fp8_block", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  const Checkpoint ck1 = make_checkpoint(c.manifest(), 1);
  ASSERT_TRUE(c.update(1, ck1).ok());
  const int pauses = total_pauses(c);
  const Checkpoint ck2 = make_checkpoint(c.manifest(), 2);
  coordinator::UpdateOptions o;
  o.stage = true;
  ASSERT_TRUE(c.trainer().start_weight_update(2, c.manifest(), o).ok());
  // Half the tensors, then the trainer gives up.
  size_t n = 0;
  for (const auto& [name, view] : ck2.views) {
    if (n++ % 2 == 0) {
      ASSERT_TRUE(c.trainer().send(name, view).ok());
    }
  }
  ASSERT_TRUE(c.trainer().abort_weight_update("the step diverged").ok());
  EXPECT_EQ(total_pauses(c), pauses) << "a staging replica never paused";
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_TRUE(c.rank(i).worker->consistent());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 1u);
  }
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8Block, ck1), "v1 after a staged v2 failed");
  // The next update goes through as any other.
  auto r = c.update(3, ck2);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8Block, ck2), "v3");
}

}  // namespace
}  // namespace ferry::testutil

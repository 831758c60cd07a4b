// What a sending trainer keeps and how it sends deltas, end to end (FERRY_DELTA=on over tcp): the
// bound on its copies (FERRY_DELTA_MAX_BYTES), buckets of deltas sent before the bucket rule
// would send them, and copies brought up to date by the compare, through an update that fails. Every update's storage
// against a dense update's reference (scheme_bytes.h).
#include <gtest/gtest.h>

#include <mutex>
#include <random>
#include <string>

#include <fmt/format.h>

#include "dataplane/bucket_sender.h"
#include "tests/common/scoped_env.h"
#include "tests/common/warnings.h"
#include "tests/coordinator/scheme_bytes.h"
#include "tests/coordinator/version_changes.h"

namespace ferry::testutil {
namespace {

// The bytes of every tensor of the model's checkpoint.
uint64_t manifest_bytes(const Config& cfg) {
  uint64_t total = 0;
  for (const auto& t : sharding::llama_manifest(cfg.llama)) total += dtype_bytes(t.dtype, shape_numel(t.shape));
  return total;
}

// FERRY_DELTA_MAX_BYTES bounds the trainer's copies: the tensors that fit keep travelling as deltas,
// those past the bound travel whole every update, one warning names the bound, and every update
// still lands the reference's bytes.
TEST(DeltaBound, TensorsPastTheBoundTravelWholeAndTheRestAsDeltas) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  const uint64_t total = manifest_bytes(cfg);
  const uint64_t bound = total / 2;
  ScopedEnv max_bytes("FERRY_DELTA_MAX_BYTES", std::to_string(bound));
  CaughtWarnings warnings;  // before the cluster: it outlives every thread that logs
  Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 5);
  std::mt19937_64 rng(3);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) nudge(ck, 0.01, rng);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    EXPECT_GT(r->delta_copy_bytes, 0u) << "v" << v;
    EXPECT_LE(r->delta_copy_bytes, bound) << "v" << v;
    uint64_t dense = 0, deltas = 0;
    for (const auto& d : r->delta) {
      dense += d.dense_bytes;
      deltas += d.delta_bytes;
    }
    if (v > 1) {
      EXPECT_GT(deltas, 0u) << "v" << v << ": the tensors within the bound travel as deltas";
      EXPECT_GT(dense, 0u) << "v" << v << ": the tensors past the bound travel whole";
    }
    expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), fmt::format("v{}", v));
  }
  EXPECT_EQ(warnings.count("FERRY_DELTA_MAX_BYTES=" + std::to_string(bound)), 1u) << "one warning names the bound";
}

// A bucket holding compared parts is sent at the end of a tensor once its parts were an eighth of
// a bucket's dense bytes, so that ranks apply while the trainer compares the rest: with buckets as
// large as a rank's whole share and some, a dense update sends one per rank and a delta update
// several.
// The report says what the compares and the kept copies cost the trainer.
TEST(DeltaBuckets, ABucketOfComparedPartsGoesOnceItHoldsAnEighthOfABucket) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  const uint64_t total = manifest_bytes(cfg);
  // A rank's share, with room for what every rank holds whole (norms, replicated KV heads).
  ScopedEnv bucket("FERRY_BUCKET_BYTES", std::to_string(total * 3 / (2 * static_cast<uint64_t>(cfg.tp))));
  Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 7);
  std::mt19937_64 rng(9);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) nudge(ck, 0.01, rng);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), fmt::format("v{}", v));
    ASSERT_EQ(r->buckets.size(), static_cast<size_t>(cfg.tp));
    // A dense update copies what it sent; a delta update's compare brings the copies up to date as
    // it goes (dataplane/tensor_scan.h), and no copy is taken after.
    if (v == 1) {
      EXPECT_GT(r->copy_seconds, 0.0) << "v1: copies are kept for the next update";
    } else {
      EXPECT_EQ(r->copy_seconds, 0.0) << "v" << v << ": the copies were kept by the compare";
    }
    for (size_t rank = 0; rank < r->buckets.size(); ++rank) {
      if (v == 1) {
        EXPECT_EQ(r->buckets[rank], 1u) << "rank " << rank << ": a dense update's bucket holds its whole share";
        EXPECT_EQ(r->compare_seconds, 0.0) << "nothing to compare against yet";
      } else {
        EXPECT_GE(r->buckets[rank], 4u) << "v" << v << ", rank " << rank << ": compared parts held back";
        EXPECT_LE(r->buckets[rank], 10u) << "v" << v << ", rank " << rank;
        EXPECT_GT(r->compare_seconds, 0.0) << "v" << v;
      }
    }
  }
}

// The compare brings a tensor's kept copy up to the new version before its parts are sent. An
// update that fails part way through sending a tensor (a bucket in its middle cannot be posted)
// leaves the ranks on the version before (they staged) and the copies of the tensors the trainer
// compared at the failed one: the next update goes dense (the coordinator drops the ranks' delta
// bases after a failure; the copy of the tensor whose send failed also has no version) and lands
// the reference's bytes, and the one after is deltas against the copies that update kept, and
// lands them too.
TEST(DeltaKept, AnUpdateThatFailsInsideATensorIsFollowedByExactUpdates) {
  ScopedEnv transport("FERRY_TRANSPORT", "tcp");
  ScopedEnv delta("FERRY_DELTA", "on");
  ScopedEnv stage("FERRY_STAGE", "on");
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  // Buckets of a few rows: every large tensor's pieces span several.
  ScopedEnv bucket("FERRY_BUCKET_BYTES", std::to_string(manifest_bytes(cfg) / 64));
  struct Failing {
    std::mutex mu;
    bool armed = false;
    int seen = 0;
    ~Failing() { dataplane::set_sealed_bucket_hook_for_testing({}); }
  } failing;
  dataplane::set_sealed_bucket_hook_for_testing([&](int, int tp_rank, uint8_t*, size_t) {
    std::lock_guard<std::mutex> lock(failing.mu);
    if (!failing.armed || tp_rank != 0 || ++failing.seen != 5) return ok_status();
    return Status::unavailable("the link went down");
  });
  Cluster c(cfg.tp, "fp8_per_channel", cfg.llama);
  ASSERT_TRUE(c.start().ok());
  Checkpoint ck = make_checkpoint(c.manifest(), 11);
  std::mt19937_64 rng(12);
  for (uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) nudge(ck, 0.01, rng);
    ASSERT_TRUE(c.update(v, ck).ok()) << "v" << v;
  }
  const auto v2 = expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck);
  nudge(ck, 0.01, rng);
  {
    std::lock_guard<std::mutex> lock(failing.mu);
    failing.armed = true;
  }
  auto r = c.update(3, ck);
  ASSERT_FALSE(r.ok()) << "the bucket that could not be posted failed nothing";
  EXPECT_NE(r.status().to_string().find("the link went down"), std::string::npos) << r.status().to_string();
  ASSERT_TRUE(c.trainer().abort_weight_update("a link went down").ok());
  {
    std::lock_guard<std::mutex> lock(failing.mu);
    failing.armed = false;
  }
  for (int i = 0; i < c.tp(); ++i) {
    ASSERT_TRUE(c.rank(i).worker->wait_serving(10'000).ok());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 2u) << "rank " << i;
  }
  expect_storage(c, v2, "v2 after v3 failed");
  for (uint64_t v = 4; v <= 5; ++v) {
    nudge(ck, 0.01, rng);
    r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    for (const auto& d : r->delta) EXPECT_EQ(d.delta_bytes == 0, v == 4) << "v" << v << ": " << d.delta_bytes;
    expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), fmt::format("v{}", v));
  }
}

}  // namespace
}  // namespace ferry::testutil

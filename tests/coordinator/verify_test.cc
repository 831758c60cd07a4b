// FERRY_VERIFY end to end: one payload byte of one bucket flipped between sealing and posting fails
// the update with DataLoss and lands none of that bucket's bytes, the next clean update
// lands byte-exact, and without FERRY_VERIFY the same flip lands in storage unnoticed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include <fmt/format.h>

#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "tests/common/scoped_env.h"
#include "tests/coordinator/scheme_bytes.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;

// Flips one payload byte of the `target`-th bucket (0-based) sent to TP rank `rank` after arm(),
// once; remembers the parameters that bucket carried pieces of.
class Corrupter {
 public:
  Corrupter() {
    dataplane::set_sealed_bucket_hook_for_testing([this](int, int tp_rank, uint8_t* data, size_t size) {
      std::lock_guard<std::mutex> lock(mu_);
      const int seq = seen_[tp_rank]++;
      if (!armed_ || tp_rank != rank_ || seq != target_) return ok_status();
      armed_ = false;
      wire::BucketHeader h;
      Status st = dataplane::decode_bucket(data, size, &h);
      if (!st.ok() || h.pieces_size() == 0 || h.pieces(0).ref_alloc() != 0 || h.pieces(0).offset() % 2 != 0) {
        error_ = "bucket to corrupt: " + st.to_string();
        return ok_status();
      }
      for (const auto& p : h.pieces()) params_.insert(static_cast<int>(p.param()));
      // The high byte of the first bf16 element: its exponent moves by 2^64 or more.
      data[h.pieces(0).offset() + 1] ^= 0x40;
      first_param_ = static_cast<int>(h.pieces(0).param());
      flipped_ = true;
      return ok_status();
    });
  }
  ~Corrupter() { dataplane::set_sealed_bucket_hook_for_testing(nullptr); }

  void arm(int rank, int target) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    rank_ = rank;
    target_ = target;
    seen_.clear();
    flipped_ = false;
    params_.clear();
    error_.clear();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }
  // Buckets sent to each TP rank since the last arm() or count().
  void count() {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.clear();
  }
  int seen(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_[rank];
  }
  bool flipped() {
    std::lock_guard<std::mutex> lock(mu_);
    return flipped_;
  }
  std::set<int> params() {
    std::lock_guard<std::mutex> lock(mu_);
    return params_;
  }
  int first_param() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_param_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  bool armed_ = false;
  int rank_ = 0, target_ = 0;
  std::map<int, int> seen_;
  bool flipped_ = false;
  int first_param_ = -1;
  std::set<int> params_;
  std::string error_;
};

// The smallest buckets, so that one rank's update is several buckets and the corrupted one (the
// middle one) feeds only some of its layers.
constexpr const char* kSmallBuckets = "4K";
constexpr int kCorruptRank = 0, kCorruptBucket = 1;

// The storage tensor names of the parameters of `layers` on a rank.
std::set<std::string> tensors_of_layers(const sharding::RankSpec& spec, const std::set<std::string>& layers) {
  std::set<std::string> out;
  for (const auto& p : spec.params) {
    if (!layers.count(p.layer)) continue;
    out.insert(p.name);
    if (is_linear(p.name)) out.insert(scale_name(p.name));
  }
  return out;
}

// A replica that takes several buckets per rank, in fp8_per_channel, with a Corrupter on its links.
class Verify : public ::testing::Test {
 protected:
  static constexpr Scheme scheme = Scheme::kFp8PerChannel;
  ScopedEnv buckets_{"FERRY_BUCKET_BYTES", kSmallBuckets};
  const Config cfg = several_buckets();
  const Layout layout = make_layout(cfg, std::string(scheme_name(scheme)));
  Corrupter corrupt;
  Cluster c{cfg.tp, std::string(scheme_name(scheme)), cfg.llama};  // started by each test
};

TEST_F(Verify, CorruptedBucketFailsWithDataLossAndTheNextUpdateLands) {
  ScopedEnv verify("FERRY_VERIFY", "1");
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();

  const Checkpoint a = make_checkpoint(c.manifest(), 1), b = make_checkpoint(c.manifest(), 2),
                   d = make_checkpoint(c.manifest(), 3);
  corrupt.count();
  auto r = c.update(1, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_GT(corrupt.seen(kCorruptRank), kCorruptBucket + 1) << "buckets too large to corrupt one mid-update";
  const auto want_a = expected_storage(cfg, layout, scheme, a);
  expect_storage(c, want_a, "v1");

  corrupt.arm(kCorruptRank, kCorruptBucket);
  r = c.update(2, b);
  ASSERT_TRUE(corrupt.flipped()) << corrupt.error();
  ASSERT_FALSE(r.ok()) << "a bucket corrupted in flight landed under FERRY_VERIFY=1";
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  EXPECT_THAT(r.status().message(), HasSubstr("checksum"));
  EXPECT_THAT(r.status().message(), HasSubstr(fmt::format("replica 0 rank {}", kCorruptRank)));

  // Every rank stays paused on v1, marked inconsistent; nothing of the corrupted bucket landed: the
  // layers it fed hold, byte for byte, v1's bytes or v2's (rows that came in clean buckets may be in
  // storage already).
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_TRUE(c.rank(i).worker->paused()) << "rank " << i;
    EXPECT_FALSE(c.rank(i).worker->consistent()) << "rank " << i;
    EXPECT_EQ(c.rank(i).resumes, 1) << "rank " << i;
    EXPECT_EQ(c.rank(i).last_resume, 1u) << "rank " << i;
  }
  const auto& spec = layout.specs[kCorruptRank];
  std::set<std::string> hit_layers;
  for (int p : corrupt.params()) hit_layers.insert(spec.params.at(static_cast<size_t>(p)).layer);
  ASSERT_FALSE(hit_layers.empty());
  const auto want_b = expected_storage(cfg, layout, scheme, b);
  const RankBytes now = storage_bytes(c.rank(kCorruptRank));
  for (const std::string& t : tensors_of_layers(spec, hit_layers)) {
    SCOPED_TRACE(t);
    const Bytes &mine = now.at(t), &v1 = want_a[kCorruptRank].at(t), &v2 = want_b[kCorruptRank].at(t);
    ASSERT_EQ(mine.size(), v1.size());
    size_t neither = 0;
    for (size_t k = 0; k < mine.size(); ++k) neither += mine[k] != v1[k] && mine[k] != v2[k];
    EXPECT_EQ(neither, 0u) << "bytes of the corrupted bucket landed";
    EXPECT_GT(differing(want_b[kCorruptRank].at(t), want_a[kCorruptRank].at(t)), 0u);  // else that proves nothing
  }

  // The next clean update lands byte-exact and resumes every rank.
  corrupt.disarm();
  r = c.update(3, d);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_storage(c, expected_storage(cfg, layout, scheme, d), "v3 after the corrupted v2");
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_FALSE(c.rank(i).worker->paused()) << "rank " << i;
    EXPECT_TRUE(c.rank(i).worker->consistent()) << "rank " << i;
    EXPECT_EQ(c.rank(i).last_resume, 3u) << "rank " << i;
  }
}

// The contrast: without FERRY_VERIFY the same flip is not caught. The update succeeds, and the
// corrupted parameter, and nothing else, differs from the reference in storage.
TEST_F(Verify, WithoutVerifyTheSameCorruptionLandsUnnoticed) {
  ScopedEnv verify("FERRY_VERIFY", "0");
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();

  const Checkpoint a = make_checkpoint(c.manifest(), 1), b = make_checkpoint(c.manifest(), 2);
  auto r = c.update(1, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_storage(c, expected_storage(cfg, layout, scheme, a), "v1");

  corrupt.arm(kCorruptRank, kCorruptBucket);
  r = c.update(2, b);
  ASSERT_TRUE(corrupt.flipped()) << corrupt.error();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto want_b = expected_storage(cfg, layout, scheme, b);
  const auto& spec = layout.specs[kCorruptRank];
  const std::string victim = spec.params.at(static_cast<size_t>(corrupt.first_param())).name;
  RankBytes now = storage_bytes(c.rank(kCorruptRank));
  std::set<std::string> differ;
  for (const auto& [t, bytes] : want_b[kCorruptRank]) {
    if (differing(now.at(t), bytes)) differ.insert(t);
  }
  std::set<std::string> victim_tensors{victim};
  if (is_linear(victim)) victim_tensors.insert(scale_name(victim));
  EXPECT_FALSE(differ.empty()) << "the flipped byte did not reach storage";
  for (const auto& t : differ) EXPECT_TRUE(victim_tensors.count(t)) << t << " differs, but only " << victim << " was hit";
  for (int i = 0; i < c.tp(); ++i) {
    if (i == kCorruptRank) continue;
    const std::string diff = compare(want_b[static_cast<size_t>(i)], storage_bytes(c.rank(i)));
    EXPECT_EQ(diff, "") << "rank " << i << ":\n" << diff;
  }
}

}  // namespace
}  // namespace ferry::testutil

// Sharded trainers: several trainer ranks, each a process of its own holding only its box of every
// tensor, update one TP replica together; every storage byte of every rank is compared with the
// reference of scheme_bytes.h (built without ferry's sharding or kernels). Holdings that do not tile
// the manifest fail at start with nothing paused; a trainer rank that dies fails the update on every
// other trainer rank, naming it, and the next update with the rank back succeeds.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/coordinator.h"
#include "tests/common/scoped_env.h"
#include "tests/coordinator/process.h"
#include "tests/coordinator/sharded.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;

// The staging and scratch the replica's ranks allocated in update `v`, from a trainer rank's log
// (UINT64_MAX when the update's line is missing).
uint64_t allocated(const std::string& log, uint64_t v) {
  const size_t line = log.find(fmt::format("v{} ok ", v));
  if (line == std::string::npos) return UINT64_MAX;
  const size_t at = log.find("allocated=", line);
  if (at == std::string::npos || at > log.find('\n', line)) return UINT64_MAX;
  return std::stoull(log.substr(at + 10));
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A standalone coordinator, a TP replica of sharded_config(tp) in this process, and trainer ranks
// as processes.
class ShardedTrainer : public ::testing::Test {
 protected:
  void start(int tp, Scheme scheme) {
    cfg_ = sharded_config(tp);
    scheme_ = scheme;
    auto co = coordinator::Coordinator::start({});
    ASSERT_TRUE(co.ok()) << co.status().to_string();
    coordinator_ = std::move(*co);
    cluster_ = std::make_unique<Cluster>(tp, std::string(scheme_name(scheme)), cfg_.llama);
    ASSERT_TRUE(cluster_->start_ranks(coordinator_->address()).ok());
    ASSERT_TRUE(coordinator_->wait_for_ranks(tp, 10'000).ok());
    scribble(*cluster_);
  }

  // Trainer ranks 0..ranks-1 sending versions first..last; waits for all of them.
  std::vector<std::string> run(int ranks, const std::string& layout, uint64_t first, uint64_t last) {
    std::vector<std::unique_ptr<Child>> children;
    for (int r = 0; r < ranks; ++r) children.push_back(spawn(r, ranks, layout, first, last));
    return wait(children, ranks);
  }

  std::unique_ptr<Child> spawn(int r, int ranks, const std::string& layout, uint64_t first, uint64_t last,
                               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {FERRY_TRAINER_RANK, out(r), coordinator_->address(), std::to_string(r),
                                     std::to_string(ranks), layout, std::to_string(cluster_->tp()),
                                     std::to_string(first), std::to_string(last)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto c = std::make_unique<Child>(args);
    EXPECT_TRUE(c->ok());
    return c;
  }

  std::vector<std::string> wait(std::vector<std::unique_ptr<Child>>& children, int ranks) {
    for (auto& c : children) EXPECT_NE(c->wait_exit(60'000), -1) << "a trainer rank did not exit";
    std::vector<std::string> lines;
    for (int r = 0; r < ranks; ++r) lines.push_back(slurp(out(r)));
    return lines;
  }

  std::string out(int r) const {
    return fmt::format("{}/ferry-trainer-rank-{}-{}.log", ::testing::TempDir(), getpid(), r);
  }

  void TearDown() override {
    for (int r = 0; r < 8; ++r) std::remove(out(r).c_str());
  }

  void expect_version(uint64_t v, bool small_steps = false) {
    const Layout layout = make_layout(cfg_, std::string(scheme_name(scheme_)));
    const Checkpoint ck = version_checkpoint(cluster_->manifest(), v, small_steps);
    expect_storage(*cluster_, expected_storage(cfg_, layout, scheme_, ck), fmt::format("v{}", v));
    for (int i = 0; i < cluster_->tp(); ++i) {
      EXPECT_EQ(cluster_->rank(i).worker->weight_version(), v);
      EXPECT_TRUE(cluster_->rank(i).worker->consistent());
    }
  }

  Config cfg_;
  Scheme scheme_ = Scheme::kNone;
  std::unique_ptr<coordinator::Coordinator> coordinator_;
  std::unique_ptr<Cluster> cluster_;
};

// Four FSDP2 Shard(0) ranks (uneven shards of the 301-row vocabulary) into a TP-2 replica with
// fused qkv / gate_up and a padded vocabulary; three versions, each over the last. The ranks
// allocate their staging and scratch in the first update and reuse it after, as the finish report
// tells every trainer rank (Staging.TheNextOutOfOrderUpdateAllocatesNothing holds more layers open
// than the pool's one-layer floor).
TEST_F(ShardedTrainer, FourFsdpRanksUpdateATp2Replica) {
  start(2, Scheme::kFp8PerChannel);
  const auto lines = run(4, "fsdp", 1, 3);
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(lines[r], HasSubstr("v2 ok")) << "trainer rank " << r << ": " << lines[r];
    const uint64_t first = allocated(lines[r], 1), third = allocated(lines[r], 3);
    ASSERT_NE(first, UINT64_MAX) << "trainer rank " << r << ": " << lines[r];
    ASSERT_NE(third, UINT64_MAX) << "trainer rank " << r << ": " << lines[r];
    EXPECT_GT(first, 0u) << "trainer rank " << r << ": " << lines[r];
    EXPECT_LE(third, first / 2) << "trainer rank " << r << ": " << lines[r];
  }
  expect_version(3);
}

// Deltas from a sharded trainer: each trainer rank keeps the copy of its own rows and sends only
// what changed in them; after the first (dense) update every rank's pieces travel as deltas, and
// storage matches the reference each time. HSDP's replicated rows too: any holder's copy is the
// version every rank holds.
TEST_F(ShardedTrainer, EachTrainerRankSendsDeltasOfItsOwnRows) {
  for (const char* layout : {"fsdp", "hsdp"}) {
    SCOPED_TRACE(layout);
    start(2, Scheme::kFp8PerChannel);
    ScopedEnv steps("FERRY_TEST_SMALL_STEPS", "1");
    ScopedEnv delta("FERRY_DELTA", "on");  // the ranks are on this host, where auto sends dense
    const auto lines = run(4, layout, 1, 3);
    for (int r = 0; r < 4; ++r) {
      EXPECT_THAT(lines[r], HasSubstr("v1 ok")) << "trainer rank " << r << ": " << lines[r];
      EXPECT_THAT(lines[r], HasSubstr("delta=0\n")) << "the first update is dense: " << lines[r];
      EXPECT_THAT(lines[r], ::testing::ContainsRegex("v3 ok .* delta=[1-9]")) << "trainer rank " << r << ": " << lines[r];
    }
    expect_version(3, /*small_steps=*/true);
    cluster_.reset();
    coordinator_.reset();
  }
}

// HSDP 2 x 2: shards replicated across two groups; each part is sent by one of its two holders,
// balanced, and the storage is the same as from whole tensors.
TEST_F(ShardedTrainer, HsdpReplicatedShardsAreSentOnceAndBalanced) {
  start(2, Scheme::kNone);
  const auto lines = run(4, "hsdp", 1, 1);
  for (int r = 0; r < 4; ++r) EXPECT_THAT(lines[r], HasSubstr("v1 ok")) << "trainer rank " << r << ": " << lines[r];
  expect_version(1);

  const Layout layout = make_layout(cfg_, "none");
  const auto manifest = cluster_->manifest();
  std::vector<sharding::SenderInfo> senders;
  for (int r = 0; r < 4; ++r) senders.push_back(holdings_for("hsdp", manifest, r, 4));
  auto plan = sharding::make_plan(manifest, layout.specs, senders);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  for (int pair = 0; pair < 2; ++pair) {
    const double a = static_cast<double>(plan->bytes_per_sender[pair]);
    const double b = static_cast<double>(plan->bytes_per_sender[pair + 2]);
    EXPECT_GT(a, 0);
    EXPECT_LE(std::abs(a - b), 0.1 * std::max(a, b)) << "holders of shard " << pair << " send " << a << " and " << b;
  }
}

// A TP-2 Megatron-Core trainer (fused linear_qkv interleaved per KV-head group, [gate; up]
// linear_fc1, row-parallel linear_proj / linear_fc2 by columns, vocabulary rows padded) sending from
// its fused local tensors through its source layout into a TP-4 replica.
TEST_F(ShardedTrainer, MegatronTp2TrainerUpdatesATp4Replica) {
  start(4, Scheme::kFp8PerChannel);
  const auto lines = run(2, "megatron", 1, 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(lines[r], HasSubstr("v1 ok")) << "trainer rank " << r << ": " << lines[r];
    EXPECT_THAT(lines[r], HasSubstr("v2 ok")) << "trainer rank " << r << ": " << lines[r];
  }
  expect_version(2);
}

// Two pipeline stages, each owning its layers whole, into a TP-1 replica.
TEST_F(ShardedTrainer, TwoPipelineStagesUpdateATp1Replica) {
  start(1, Scheme::kInt8PerChannel);
  const auto lines = run(2, "pipeline", 1, 1);
  for (int r = 0; r < 2; ++r) EXPECT_THAT(lines[r], HasSubstr("v1 ok")) << "trainer rank " << r << ": " << lines[r];
  expect_version(1);
}

// Holdings that leave a gap or claim one row twice fail every trainer rank at start, naming the
// tensor and the rows; no rank paused and no storage byte changed.
TEST_F(ShardedTrainer, HoldingsThatDoNotTileFailAtStartWithNothingPaused) {
  start(2, Scheme::kNone);
  const uint64_t before = cluster_->rank(0).fingerprint() ^ cluster_->rank(1).fingerprint();
  for (const std::string layout : {"gap", "overlap"}) {
    const auto lines = run(4, layout, 1, 1);
    for (int r = 0; r < 4; ++r) {
      EXPECT_THAT(lines[r], HasSubstr("v1 error")) << layout << " trainer rank " << r << ": " << lines[r];
      EXPECT_THAT(lines[r], HasSubstr("Nothing was paused")) << lines[r];
      EXPECT_THAT(lines[r], HasSubstr(layout == "gap" ? "lm_head.weight" : "model.embed_tokens.weight")) << lines[r];
    }
    EXPECT_THAT(lines[0], HasSubstr(layout == "gap" ? "nothing holds rows [300, 301)" : "overlap")) << lines[0];
    std::remove(out(0).c_str());
    for (int r = 1; r < 4; ++r) std::remove(out(r).c_str());
  }
  EXPECT_EQ(cluster_->rank(0).pauses.load() + cluster_->rank(1).pauses.load(), 0);
  EXPECT_EQ(cluster_->rank(0).fingerprint() ^ cluster_->rank(1).fingerprint(), before);
}

// One trainer rank declares a global shape the others do not: the update does not open for any of
// them, the message names the rank and both manifests, and nothing pauses.
TEST_F(ShardedTrainer, ATrainerRankWithAnotherGlobalShapeFailsAtStartWithNothingPaused) {
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "3000");  // ranks that start after the refusal wait this long
  start(2, Scheme::kNone);
  const auto lines = run(4, "wrongshape", 1, 1);
  for (int r = 0; r < 4; ++r) EXPECT_THAT(lines[r], HasSubstr("v1 error")) << "trainer rank " << r << ": " << lines[r];
  const std::string all = lines[0] + lines[1] + lines[2] + lines[3];
  EXPECT_THAT(all, HasSubstr("every trainer rank must start the same update once"));
  EXPECT_THAT(all, HasSubstr("Nothing was paused"));
  EXPECT_EQ(cluster_->rank(0).pauses.load() + cluster_->rank(1).pauses.load(), 0);
}

// A trainer rank that never sends a tensor it holds fails its own finish naming the checkpoint
// tensor (not a layer gap found by the ranks later), and the update fails for every trainer rank.
TEST_F(ShardedTrainer, ATrainerRankThatForgetsATensorFailsNamingIt) {
  start(2, Scheme::kNone);
  const auto lines = run(4, "forget", 1, 1);
  EXPECT_THAT(lines[1], HasSubstr("trainer rank 1 of 4 did not send 1 tensor(s) of the manifest it holds: "
                                  "model.norm.weight")) << lines[1];
  for (int r = 0; r < 4; ++r) EXPECT_THAT(lines[r], HasSubstr("v1 error")) << "trainer rank " << r << ": " << lines[r];
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(cluster_->rank(i).worker->consistent());
}

// Trainer rank 2 dies in the middle of v2: every other trainer rank's v2 fails, naming it, the
// replica does not resume on a mix of v1 and v2, and v3 with rank 2 back (a new process) lands.
TEST_F(ShardedTrainer, ATrainerRankThatDiesFailsTheUpdateForAllAndTheNextSucceeds) {
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "3000");
  start(2, Scheme::kFp8PerChannel);
  std::vector<std::unique_ptr<Child>> children;
  for (int r = 0; r < 4; ++r) {
    children.push_back(r == 2 ? spawn(r, 4, "fsdp", 1, 2, {"2", "3"}) : spawn(r, 4, "fsdp", 1, 3));
  }
  EXPECT_EQ(children[2]->wait_exit(60'000), 9);
  auto back = spawn(2, 4, "fsdp", 3, 3);
  children[2] = std::move(back);
  const auto lines = wait(children, 4);
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(lines[r], HasSubstr("v1 ok")) << lines[r];
    EXPECT_THAT(lines[r], HasSubstr("v2 error")) << lines[r];
    EXPECT_THAT(lines[r], HasSubstr("trainer rank 2")) << lines[r];
    EXPECT_THAT(lines[r], HasSubstr("v3 ok")) << lines[r];
  }
  EXPECT_THAT(lines[2], HasSubstr("v3 ok")) << lines[2];
  expect_version(3);
}

}  // namespace
}  // namespace ferry::testutil

// The plan owns the buckets: an update over each transport posts exactly the buckets the planner
// cut for the cost model, and a trainer and a rank whose FERRY_BUCKET_BYTES differ (two processes)
// complete an update, the rank taking buckets far larger than its own setting would size.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "sharding/planner.h"
#include "tests/common/scoped_env.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/process.h"
#include "transport/transport.h"

namespace ferry::testutil {
namespace {

std::vector<std::string> host_transports() {
  std::vector<std::string> out;
  for (const auto& f : transport::transport_factories()) {
    if (f.name == "tcp" || f.name == "shm" || f.name == "ucx") out.emplace_back(f.name);
  }
  return out;
}

// The planner's buckets per rank, for the cluster's manifest and ranks at `bucket_bytes`.
std::vector<uint64_t> planned_buckets(const sharding::LlamaConfig& cfg, int tp, Scheme scheme, uint64_t bucket_bytes,
                                      uint64_t* largest) {
  std::vector<sharding::RankSpec> ranks;
  for (int r = 0; r < tp; ++r) ranks.push_back(*sharding::llama_rank_spec(cfg, r, tp, scheme));
  auto plan = sharding::make_plan(sharding::llama_manifest(cfg), ranks, {sharding::SenderInfo{}},
                                  sharding::PlanOptions{bucket_bytes});
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  std::vector<uint64_t> per_rank(static_cast<size_t>(tp), 0);
  *largest = 0;
  for (const auto& b : plan->buckets) {
    ++per_rank[static_cast<size_t>(b.dst)];
    *largest = std::max(*largest, b.bytes);
  }
  return per_rank;
}

// Small buckets cut pieces by rows (the embedding and MLP shards span several); whatever the
// transport, the update posts the plan's buckets to each rank, and the ranks' storage is the same.
TEST(BucketPlan, EveryTransportSendsThePlansBuckets) {
  constexpr uint64_t kBucket = 8 << 10;
  // The storage of the same update in 64 MiB buckets (one per rank, no piece cut), over tcp.
  uint64_t reference = 0;
  {
    ScopedEnv transport("FERRY_TRANSPORT", "tcp");
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    ASSERT_TRUE(c.update(1, Checkpoint(c.manifest(), 11)).ok());
    reference = c.rank(1).fingerprint();
  }
  ScopedEnv bytes("FERRY_BUCKET_BYTES", "8K");
  uint64_t largest = 0;
  std::vector<uint64_t> planned = planned_buckets(tiny_llama(), 2, Scheme::kFp8PerTensor, kBucket, &largest);
  std::sort(planned.begin(), planned.end());
  ASSERT_GT(planned.front(), 4u);
  for (const std::string& name : host_transports()) {
    SCOPED_TRACE(name);
    ScopedEnv transport("FERRY_TRANSPORT", name);
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    Checkpoint ck(c.manifest(), 11);
    auto r = c.update(1, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::vector<uint64_t> sent = r->buckets;
    std::sort(sent.begin(), sent.end());
    EXPECT_EQ(sent, planned) << "the buckets sent are not the plan's";
    EXPECT_EQ(c.rank(1).fingerprint(), reference) << "small buckets changed what landed";
  }
}

// The rank's transports are made with FERRY_BUCKET_BYTES=4K, which alone would let them take
// buckets of 64 MiB and a little; the trainer cuts 96 MiB ones from a model whose embedding alone
// is larger than that. Each connection announces the largest bucket it will send, so the update
// completes over every transport.
TEST(BucketPlan, ATrainerAndARankWithDifferentBucketSizesCompleteAnUpdate) {
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "20000");
  uint64_t largest = 0;
  planned_buckets(wide_llama(), 1, Scheme::kFp8PerTensor, uint64_t{96} << 20, &largest);
  ASSERT_GT(largest, (uint64_t{64} << 20) + 4 * 4096) << "the test needs a bucket beyond the rank's own limit";
  Checkpoint ck(sharding::llama_manifest(wide_llama()), 5);
  for (const std::string& name : host_transports()) {
    SCOPED_TRACE(name);
    ScopedEnv transport("FERRY_TRANSPORT", name);
    std::unique_ptr<coordinator::Trainer> trainer;
    {
      ScopedEnv big("FERRY_BUCKET_BYTES", "96M");
      auto t = coordinator::Trainer::create({});
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      trainer = std::move(*t);
    }
    std::unique_ptr<Child> rank;
    {
      ScopedEnv small("FERRY_BUCKET_BYTES", "4K");
      rank = std::make_unique<Child>(std::vector<std::string>{FERRY_FAULT_PEER, "rollout", trainer->coordinator_address(),
                                                              "0", "1", "wide"});
    }
    ASSERT_TRUE(trainer->wait_for_ranks(1, 30'000).ok());
    ASSERT_TRUE(trainer->start_weight_update(1, sharding::llama_manifest(wide_llama())).ok());
    coordinator::MapSource src(ck.views);
    Status sent = trainer->update_weights(src);
    auto r = trainer->finish_weight_update();
    ASSERT_TRUE(sent.ok()) << sent.to_string();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->ranks, 1);
    trainer.reset();
    EXPECT_EQ(rank->wait_exit(30'000), 0) << "the rank did not end cleanly";
  }
}

}  // namespace
}  // namespace ferry::testutil

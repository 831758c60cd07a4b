// BucketSender refuses what it cannot send correctly, before it connects to anyone.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dataplane/bucket_sender.h"
#include "proto/ferry.pb.h"
#include "sharding/llama.h"
#include "sharding/planner.h"

namespace ferry::dataplane {
namespace {

// Each trainer rank sends the pieces the plan gives its index: an index the plan does not have would
// send nothing and leave the ranks waiting, so it is refused before any connection.
TEST(BucketSender, RefusesASenderIndexOutsideThePlan) {
  sharding::LlamaConfig c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 128;
  c.vocab_size = 100;
  c.num_layers = 1;
  const std::vector<sharding::RankSpec> ranks = {*sharding::llama_rank_spec(c, 0, 1, Scheme::kNone)};
  auto plan = sharding::make_plan(sharding::llama_manifest(c), ranks, std::vector<sharding::SenderInfo>(2),
                                  sharding::PlanOptions{4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  BucketSender sender(BucketSenderSettings{}, [] {});
  const Status st = sender.prepare(1, std::make_shared<const sharding::Plan>(std::move(*plan)), ranks, {{}}, {"cpu"},
                                   BucketSender::Identity{0, "", {}, 2, {}});
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_THAT(st.message(), ::testing::HasSubstr("sender 2 of a plan of 2 senders"));
}

}  // namespace
}  // namespace ferry::dataplane

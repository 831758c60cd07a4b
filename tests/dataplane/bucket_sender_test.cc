// BucketSender refuses what it cannot send correctly, before it connects to anyone.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dataplane/bucket_sender.h"
#include "proto/ferry.pb.h"
#include "sharding/llama.h"
#include "sharding/planner.h"

namespace ferry::dataplane {
namespace {

// A plan that splits the manifest between two senders (holdings) needs each trainer rank to send
// only its own pieces from its own shard; the sender reads every piece from the whole tensor, so it
// must refuse such a plan rather than send every piece from every rank.
TEST(BucketSender, RefusesAPlanOfSeveralSenders) {
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
                                   BucketSender::Identity{});
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_THAT(st.message(), ::testing::HasSubstr("2 senders"));
}

}  // namespace
}  // namespace ferry::dataplane

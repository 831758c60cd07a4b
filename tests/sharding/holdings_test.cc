// Holdings: sharded trainers declare the boxes of each tensor they hold; the planner checks that
// they tile every tensor exactly and cuts each destination slice by them (the reassembly property
// tests check the placement of every element for random sharded holdings, reassembly_test.cc).
#include <algorithm>
#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sharding/llama.h"
#include "sharding/planner.h"

namespace ferry::sharding {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

LlamaConfig small() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 128;
  c.vocab_size = 100;
  c.num_layers = 2;
  return c;
}

std::vector<RankSpec> tp2() {
  std::vector<RankSpec> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(*llama_rank_spec(small(), r, 2, Scheme::kNone));
  return ranks;
}

Region rows(const Shape& shape, int64_t from, int64_t to) {
  Region r = Region::whole(shape);
  r.offset[0] = from;
  r.size[0] = to - from;
  return r;
}

// Every tensor split by rows at `cut` between sender 0 (above) and sender 1 (below).
std::vector<SenderInfo> split_at(const Manifest& m, double cut) {
  std::vector<SenderInfo> s(2);
  for (const SourceTensor& t : m) {
    if (t.shape.empty()) {
      s[0].holds.push_back(Holding{t.name, Region::whole(t.shape)});
      continue;
    }
    const int64_t at = static_cast<int64_t>(static_cast<double>(t.shape[0]) * cut);
    s[0].holds.push_back(Holding{t.name, rows(t.shape, 0, at)});
    s[1].holds.push_back(Holding{t.name, rows(t.shape, at, t.shape[0])});
  }
  return s;
}

TEST(Holdings, EachPieceLiesInABoxItsSenderHolds) {
  const Manifest m = llama_manifest(small());
  const auto senders = split_at(m, 0.37);
  auto plan = make_plan(m, tp2(), senders, PlanOptions{4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  uint64_t bytes = 0;
  for (const Piece& pc : plan->pieces) {
    bool inside = false;
    for (const Holding& h : senders[static_cast<size_t>(pc.sender)].holds) {
      const auto part = intersect(pc.src, h.region);
      inside = inside || (m[static_cast<size_t>(pc.source)].name == h.name && part && *part == pc.src);
    }
    EXPECT_TRUE(inside) << m[static_cast<size_t>(pc.source)].name << " " << pc.src.to_string();
    bytes += pc.bytes;
  }
  EXPECT_EQ(bytes, plan->total_bytes);
  EXPECT_GT(plan->bytes_per_sender[0], 0u);
  EXPECT_GT(plan->bytes_per_sender[1], 0u);
}

TEST(Holdings, AGapIsRefusedNamingTheTensorAndTheRows) {
  const Manifest m = llama_manifest(small());
  auto senders = split_at(m, 0.5);
  const std::string name = "model.layers.1.mlp.down_proj.weight";  // [64, 128]
  for (Holding& h : senders[1].holds) {
    if (h.name == name) h.region = rows({64, 128}, 40, 64);  // rows [32, 40) held by no one
  }
  const Status st = make_plan(m, tp2(), senders, PlanOptions{4096}).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), AllOf(HasSubstr(name), HasSubstr("rows [32, 40)"), HasSubstr("7168 of its 8192")));
}

TEST(Holdings, AConflictingOverlapIsRefusedNamingBothSenders) {
  const Manifest m = llama_manifest(small());
  auto senders = split_at(m, 0.5);
  const std::string name = "model.layers.0.self_attn.q_proj.weight";  // [64, 64]
  for (Holding& h : senders[1].holds) {
    if (h.name == name) h.region = rows({64, 64}, 30, 64);
  }
  const Status st = make_plan(m, tp2(), senders, PlanOptions{4096}).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), AllOf(HasSubstr(name), HasSubstr("sender 0"), HasSubstr("sender 1"), HasSubstr("overlap"),
                                  HasSubstr("[30:64, 0:64]")));
}

TEST(Holdings, UnknownTensorsAndBoxesOutsideAreRefused) {
  const Manifest m = llama_manifest(small());
  auto senders = split_at(m, 0.5);
  senders[0].holds.push_back(Holding{"model.nothing.weight", Region::whole({4, 4})});
  EXPECT_THAT(make_plan(m, tp2(), senders, PlanOptions{4096}).status().message(),
              AllOf(HasSubstr("sender 0"), HasSubstr("model.nothing.weight")));
  senders = split_at(m, 0.5);
  senders[1].holds.back().region.size[0] += 1;
  EXPECT_THAT(make_plan(m, tp2(), senders, PlanOptions{4096}).status().message(), HasSubstr("outside its shape"));
}

// HSDP: two groups hold the same two shards. Each part goes from one of its two holders, and the
// four senders end within a piece of an even split.
TEST(Holdings, ReplicatedBoxesAreSentOnceAndBalanced) {
  const Manifest m = llama_manifest(small());
  auto half = split_at(m, 0.5);
  std::vector<SenderInfo> senders = {half[0], half[1], half[0], half[1]};
  auto plan = make_plan(m, tp2(), senders, PlanOptions{4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  auto single = make_plan(m, tp2(), half, PlanOptions{4096});
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(plan->total_bytes, single->total_bytes) << "a replicated part was planned twice";
  EXPECT_EQ(plan->pieces.size(), single->pieces.size());
  uint64_t biggest = 0;
  for (const Piece& pc : plan->pieces) biggest = std::max(biggest, pc.bytes);
  const auto [lo, hi] = std::minmax_element(plan->bytes_per_sender.begin(), plan->bytes_per_sender.end());
  EXPECT_GT(*lo, 0u);
  EXPECT_LE(*hi - *lo, 2 * biggest);
}

}  // namespace
}  // namespace ferry::sharding

// Property tests: for random configurations, reassembling every rank's planned pieces puts each
// source element exactly where the layout (tests/sharding/oracle.cc) says, once, bit for bit.
#include <algorithm>
#include <random>
#include <tuple>

#include <gtest/gtest.h>

#include "sharding/layout.h"
#include "sharding/llama.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "tests/sharding/oracle.h"

namespace ferry::sharding {
namespace {

using testing::TCfg;

// FSDP2's Shard(0) of every tensor over `n` senders: rows [r * ceil(R / n), ...) each, the last
// shorter and later ones empty; `groups` copies of that (HSDP), sender g * n + r holding shard r.
std::vector<SenderInfo> sharded_senders(const Manifest& m, int n, int groups) {
  std::vector<SenderInfo> senders(static_cast<size_t>(n * groups));
  for (const SourceTensor& t : m) {
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const int64_t per = (rows + n - 1) / n;
    for (int r = 0; r < n; ++r) {
      Region box = Region::whole(t.shape);
      if (!t.shape.empty()) {
        box.offset[0] = std::min<int64_t>(rows, r * per);
        box.size[0] = std::min<int64_t>(rows, (r + 1) * per) - box.offset[0];
      } else if (r > 0) {
        continue;  // a scalar is held by the first rank of each group
      }
      for (int g = 0; g < groups; ++g) senders[static_cast<size_t>(g * n + r)].holds.push_back(Holding{t.name, box});
    }
  }
  return senders;
}

std::vector<SenderInfo> random_senders(std::mt19937_64& rng, const Manifest& m) {
  const int n = std::uniform_int_distribution<int>(1, 5)(rng);
  std::vector<SenderInfo> senders(static_cast<size_t>(n));
  switch (rng() % 3) {
    case 0:
      break;  // everyone holds everything
    case 1:
      // Each sender owns a subset (round-robin over tensors); the last also owns everything again.
      for (size_t i = 0; n > 1 && i < m.size(); ++i) senders[i % static_cast<size_t>(n - 1)].owns.push_back(m[i].name);
      break;
    default:
      return sharded_senders(m, n, 1 + static_cast<int>(rng() % 2));
  }
  return senders;
}

void check_model(const TCfg& c, std::mt19937_64& rng) {
  SCOPED_TRACE(c.describe());
  auto desc = describe_model(c.model_config());
  ASSERT_TRUE(desc.ok()) << desc.status().to_string();
  if (c.stacked) {
    ASSERT_TRUE(stack_experts(*desc).ok());
  }
  auto ranks = model_rank_specs(*desc, c.replicas, c.tp, c.ep, Scheme::kNone);
  ASSERT_TRUE(ranks.ok()) << ranks.status().to_string();
  const Manifest manifest = model_manifest(*desc);
  PlanOptions opts;
  opts.bucket_bytes = std::uniform_int_distribution<uint64_t>(1, 4096)(rng);
  auto plan = make_plan(manifest, *ranks, random_senders(rng, manifest), opts);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const auto r = testing::reassemble(manifest, *ranks, *plan);
  EXPECT_EQ(testing::check_against_oracle(c, manifest, *ranks, r), "");
}

TEST(Reassembly, RandomDenseModels) {
  std::mt19937_64 rng(20240501);
  for (int trial = 0; trial < 60; ++trial) check_model(testing::random_cfg(rng, false), rng);
}

TEST(Reassembly, RandomMoeModelsWithExpertParallelism) {
  std::mt19937_64 rng(777);
  for (int trial = 0; trial < 60; ++trial) check_model(testing::random_cfg(rng, true), rng);
}

// The same models with each layer's experts held stacked by the trainer (transformers' fused
// gate_up_proj / down_proj), planned from whole boxes of experts: the same places.
TEST(Reassembly, RandomMoeModelsWithStackedExperts) {
  std::mt19937_64 rng(778);
  for (int trial = 0; trial < 60; ++trial) {
    TCfg c = testing::random_cfg(rng, true);
    c.stacked = true;
    check_model(c, rng);
  }
}

// Stacked experts from one sender: one piece per expert tensor and rank when nothing splits an
// expert (TP 1, or EP over every rank), one per rank and source (gate, up) when TP splits them;
// per-expert tensors need one per expert.
TEST(Reassembly, StackedExpertsPlanOnePiecePerRankAndSource) {
  for (const auto& [tp, ep, per_rank] : {std::tuple{1, 1, 1}, std::tuple{2, 2, 1}, std::tuple{2, 1, 2}}) {
    TCfg c;
    c.experts = 8;
    c.mi = 8;
    c.tp = tp;
    c.ep = ep;
    c.layers = 1;
    SCOPED_TRACE(c.describe());
    auto desc = describe_model(c.model_config());
    ASSERT_TRUE(desc.ok());
    auto count = [&](const ModelDesc& d, std::pair<size_t, size_t>& n) {  // (w13 pieces, w2 pieces)
      auto ranks = model_rank_specs(d, 1, tp, ep, Scheme::kNone);
      ASSERT_TRUE(ranks.ok()) << ranks.status().to_string();
      auto plan = make_plan(model_manifest(d), *ranks, {SenderInfo{}}, PlanOptions{});
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      for (const Piece& pc : plan->pieces) {
        const std::string& param = (*ranks)[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)].name;
        n.first += param.ends_with("w13_weight");
        n.second += param.ends_with("w2_weight");
      }
    };
    std::pair<size_t, size_t> per_expert{0, 0}, stacked{0, 0};
    count(*desc, per_expert);
    EXPECT_EQ(per_expert.first, static_cast<size_t>(2 * c.experts * (tp / ep)));
    ASSERT_TRUE(stack_experts(*desc).ok());
    count(*desc, stacked);
    EXPECT_EQ(stacked.first, static_cast<size_t>(tp * per_rank));
    EXPECT_EQ(stacked.second, static_cast<size_t>(tp));
    const Manifest m = model_manifest(*desc);
    EXPECT_TRUE(std::any_of(m.begin(), m.end(), [&](const SourceTensor& t) {
      return t.name == "model.layers.0.mlp.experts.gate_up_proj" && t.shape == Shape{c.experts, 2 * c.mi, c.h};
    }));
  }
}

// The Llama preset (llama_rank_spec: a LlamaConfig through describe_model) against the same oracle.
TEST(Reassembly, LlamaRankSpecMatchesOracle) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 40; ++trial) {
    TCfg c = testing::random_cfg(rng, false);
    c.replicas = 1;
    SCOPED_TRACE(c.describe());
    auto lc = to_llama_config(c.model_config());
    ASSERT_TRUE(lc.ok());
    std::vector<RankSpec> ranks;
    for (int r = 0; r < c.tp; ++r) {
      auto spec = llama_rank_spec(*lc, r, c.tp, Scheme::kNone);
      ASSERT_TRUE(spec.ok()) << spec.status().to_string();
      ranks.push_back(std::move(*spec));
    }
    const Manifest manifest = llama_manifest(*lc);
    auto plan = make_plan(manifest, ranks, {SenderInfo{}, SenderInfo{}}, PlanOptions{1 << 20});
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    EXPECT_EQ(testing::check_against_oracle(c, manifest, ranks, testing::reassemble(manifest, ranks, *plan)), "");
  }
}

// A layout bug must show: swap two ranks' specs and the oracle objects.
TEST(Reassembly, OracleCatchesMisplacedShards) {
  TCfg c;
  c.tp = 2;
  auto desc = describe_model(c.model_config());
  ASSERT_TRUE(desc.ok());
  auto ranks = model_rank_specs(*desc, 1, 2, 1, Scheme::kNone);
  ASSERT_TRUE(ranks.ok());
  std::swap((*ranks)[0].params, (*ranks)[1].params);
  const Manifest manifest = model_manifest(*desc);
  auto plan = make_plan(manifest, *ranks, {SenderInfo{}}, PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  EXPECT_NE(testing::check_against_oracle(c, manifest, *ranks, testing::reassemble(manifest, *ranks, *plan)), "");
}

TEST(Reassembly, KvHeadsReplicatedWhenTpExceedsThem) {
  TCfg c;
  c.tp = 8;
  c.kv = 2;
  c.nh = 8;
  c.inter = 8;
  c.pad = 8;  // the padded vocabulary splits over the 8 ranks
  auto desc = describe_model(c.model_config());
  ASSERT_TRUE(desc.ok());
  auto ranks = model_rank_specs(*desc, 1, 8, 1, Scheme::kNone);
  ASSERT_TRUE(ranks.ok());
  // Ranks 0..3 share KV head 0, ranks 4..7 head 1.
  for (int r = 0; r < 8; ++r) {
    const ParamSpec& qkv = (*ranks)[static_cast<size_t>(r)].params[2];
    ASSERT_EQ(qkv.name, "model.layers.0.self_attn.qkv_proj.weight");
    EXPECT_EQ(qkv.slices[1].src.offset[0], (r / 4) * c.hd);
    EXPECT_EQ(qkv.shard_rows, (std::vector<int64_t>{c.hd, c.hd, c.hd}));
  }
  const Manifest manifest = model_manifest(*desc);
  auto plan = make_plan(manifest, *ranks, {SenderInfo{}}, PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(testing::check_against_oracle(c, manifest, *ranks, testing::reassemble(manifest, *ranks, *plan)), "");
}

TEST(Reassembly, VocabPaddingLeavesTailRowsUnwritten) {
  TCfg c;
  c.tp = 4;
  c.vocab = 10;
  c.pad = 32;  // 32 rows padded, 8 per rank: ranks 0 and 1 hold rows, ranks 2 and 3 only padding
  auto desc = describe_model(c.model_config());
  ASSERT_TRUE(desc.ok());
  auto ranks = model_rank_specs(*desc, 1, 4, 1, Scheme::kNone);
  ASSERT_TRUE(ranks.ok());
  for (int r = 0; r < 4; ++r) {
    const ParamSpec& embed = (*ranks)[static_cast<size_t>(r)].params.front();
    EXPECT_EQ(embed.shape, (Shape{8, c.h}));
    EXPECT_EQ(embed.slices.size(), r < 2 ? 1u : 0u);
  }
  EXPECT_EQ((*ranks)[1].params.front().slices[0].src.size[0], 2);
}

}  // namespace
}  // namespace ferry::sharding

// The trainer layouts of sharding/trainer_layouts.h: shard_rows against torch.chunk's rule written
// out independently, and every layout's holdings accepted by resolve_holdings (they tile every
// tensor) and planned, for a dense Llama and MoE models shaped as DeepSeek-V3 / Kimi-K2 and Qwen3-MoE.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "sharding/planner.h"
#include "sharding/presets.h"
#include "sharding/layout.h"
#include "sharding/trainer_layouts.h"

namespace ferry::sharding {
namespace {

// torch.chunk(arange(n), ranks) as it is documented: chunks of ceil(n / ranks) elements taken in
// turn until none is left; the ranks past the last chunk get nothing. Returns each rank's size.
std::vector<int64_t> torch_chunk_sizes(int64_t n, int ranks) {
  const int64_t each = n / ranks + (n % ranks != 0 ? 1 : 0);
  std::vector<int64_t> out;
  int64_t left = n;
  for (int r = 0; r < ranks; ++r) {
    const int64_t take = left < each ? left : each;
    out.push_back(take);
    left -= take;
  }
  return out;
}

TEST(ShardRows, MatchesTorchChunk) {
  for (int64_t n : {0, 1, 2, 5, 6, 7, 10, 64, 100, 301, 1023}) {
    for (int ranks : {1, 2, 3, 4, 7, 8, 16, 256}) {
      const auto sizes = torch_chunk_sizes(n, ranks);
      int64_t at = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto [from, to] = shard_rows(n, r, ranks);
        EXPECT_EQ(to - from, sizes[static_cast<size_t>(r)]) << "n " << n << " rank " << r << " of " << ranks;
        if (to > from) {
          EXPECT_EQ(from, at) << "n " << n << " rank " << r << " of " << ranks;
        }
        at += sizes[static_cast<size_t>(r)];
      }
      EXPECT_EQ(at, n);
    }
  }
}

TEST(ShardRows, UnevenAndEmptyChunks) {
  // The test model's vocabulary of 301 over 4 ranks: 76, 76, 76, 73.
  EXPECT_EQ(shard_rows(301, 3, 4), (std::pair<int64_t, int64_t>{228, 301}));
  // 6 over 4: torch.chunk gives three chunks of 2; rank 3 is empty (not 2, 2, 1, 1).
  EXPECT_EQ(shard_rows(6, 2, 4), (std::pair<int64_t, int64_t>{4, 6}));
  EXPECT_EQ(shard_rows(6, 3, 4).second - shard_rows(6, 3, 4).first, 0);
  // 2 over 4: ranks 2 and 3 empty.
  EXPECT_EQ(shard_rows(2, 1, 4), (std::pair<int64_t, int64_t>{1, 2}));
  EXPECT_EQ(shard_rows(2, 2, 4).second - shard_rows(2, 2, 4).first, 0);
}

// A preset's manifest; "NAME+stacked": with its experts held stacked (stack_experts).
Manifest manifest_of(const std::string& preset) {
  const size_t plus = preset.find('+');
  auto model = preset_model(preset.substr(0, plus));
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  if (model.ok() && plus != std::string::npos) {
    EXPECT_TRUE(stack_experts(*model).ok());
  }
  return model.ok() ? model_manifest(*model) : Manifest{};
}

std::vector<SenderInfo> layout(const std::string& name, const Manifest& m, int ranks) {
  std::vector<SenderInfo> out;
  for (int r = 0; r < ranks; ++r) {
    if (name == "fsdp") out.push_back(fsdp_holdings(m, r, ranks));
    if (name == "hsdp") out.push_back(hsdp_holdings(m, r, ranks, ranks / 2));
    if (name == "pipeline") out.push_back(pipeline_holdings(m, r, ranks));
    if (name == "ep") out.push_back(expert_holdings(m, r, ranks));
  }
  return out;
}

class EveryLayout : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};

TEST_P(EveryLayout, TilesEveryTensor) {
  const auto& [preset, name, ranks] = GetParam();
  const Manifest m = manifest_of(preset);
  ASSERT_FALSE(m.empty());
  const auto senders = layout(name, m, ranks);
  for (int r = 0; r < ranks; ++r) {
    const auto& s = senders[static_cast<size_t>(r)];
    EXPECT_FALSE(s.owns.empty() && s.holds.empty()) << "rank " << r << " would read as holding everything";
  }
  auto held = resolve_holdings(m, senders);
  ASSERT_TRUE(held.ok()) << held.status().to_string();
  EXPECT_TRUE(held->everyone.empty());
}

INSTANTIATE_TEST_SUITE_P(Llama, EveryLayout,
                         ::testing::Combine(::testing::Values("llama3-8b"), ::testing::Values("fsdp", "hsdp", "pipeline", "ep"),
                                            ::testing::Values(2, 4, 6, 64)));
INSTANTIATE_TEST_SUITE_P(MoE, EveryLayout,
                         ::testing::Combine(::testing::Values("qwen3-30b-a3b", "kimi-k2", "qwen3-30b-a3b+stacked",
                                                              "kimi-k2+stacked"),
                                            ::testing::Values("fsdp", "hsdp", "pipeline", "ep"), ::testing::Values(4, 16)));

// More ranks than some tensors have rows, and more stages than layers: the extra ranks hold empty
// boxes, never "everything".
TEST(TrainerLayouts, MoreRanksThanRowsOrLayers) {
  const Manifest m = manifest_of("llama3-8b");
  for (const char* name : {"fsdp", "pipeline"}) {
    auto held = resolve_holdings(m, layout(name, m, 40));  // 32 layers; norms of 4096 rows
    ASSERT_TRUE(held.ok()) << name << ": " << held.status().to_string();
    EXPECT_TRUE(held->everyone.empty()) << name;
  }
}

TEST(TrainerLayouts, PipelineStagesHoldContiguousLayersAndTheEnds) {
  const Manifest m = manifest_of("llama3-8b");  // 32 layers over 3 stages: 10, 11, 11
  const std::vector<std::pair<int, int>> want = {{0, 10}, {10, 21}, {21, 32}};
  for (int s = 0; s < 3; ++s) {
    const SenderInfo info = pipeline_holdings(m, s, 3);
    EXPECT_TRUE(info.holds.empty());
    std::set<int> layers;
    for (const auto& n : info.owns) {
      if (layer_index_of(n) >= 0) layers.insert(layer_index_of(n));
    }
    EXPECT_EQ(*layers.begin(), want[static_cast<size_t>(s)].first) << "stage " << s;
    EXPECT_EQ(*layers.rbegin() + 1, want[static_cast<size_t>(s)].second) << "stage " << s;
    EXPECT_EQ(static_cast<int>(layers.size()), want[static_cast<size_t>(s)].second - want[static_cast<size_t>(s)].first);
    const auto has = [&](const std::string& n) { return std::find(info.owns.begin(), info.owns.end(), n) != info.owns.end(); };
    EXPECT_EQ(has("model.embed_tokens.weight"), s == 0);
    EXPECT_EQ(has("model.norm.weight"), s == 2);
    EXPECT_EQ(has("lm_head.weight"), s == 2);
  }
}

TEST(TrainerLayouts, ExpertsGoWholeToTheirEpRankInBlocks) {
  const Manifest m = manifest_of("qwen3-30b-a3b");  // 128 experts over 8 EP ranks: 16 each
  EXPECT_EQ(expert_index_of("model.layers.3.mlp.experts.17.down_proj.weight"), 17);
  EXPECT_EQ(expert_index_of("model.layers.3.mlp.shared_experts.down_proj.weight"), -1);
  EXPECT_EQ(expert_index_of("model.layers.3.mlp.gate.weight"), -1);
  for (int r = 0; r < 8; ++r) {
    const SenderInfo info = expert_holdings(m, r, 8);
    std::set<int> experts;
    for (const auto& n : info.owns) {
      ASSERT_GE(expert_index_of(n), 0) << n;
      experts.insert(expert_index_of(n));
    }
    EXPECT_EQ(experts.size(), 16u);
    EXPECT_EQ(*experts.begin(), 16 * r);
    // Everything else is Shard(0) over the 8 ranks.
    for (const auto& h : info.holds) {
      EXPECT_EQ(expert_index_of(h.name), -1) << h.name;
      const auto t = std::find_if(m.begin(), m.end(), [&](const SourceTensor& x) { return x.name == h.name; });
      const auto [from, to] = shard_rows(t->shape[0], r, 8);
      EXPECT_EQ(h.region.offset[0], from) << h.name;
      EXPECT_EQ(h.region.size[0], to - from) << h.name;
    }
  }
}

// Kimi-K2's 384 experts over 256 EP ranks: blocks of one or two, none empty (torch.chunk's rule
// would leave the last 64 ranks without an expert).
TEST(TrainerLayouts, ExpertsThatDoNotDivideStillReachEveryRank) {
  const Manifest m = manifest_of("kimi-k2");
  for (const auto& [rank, first, count] : std::vector<std::tuple<int, int, size_t>>{{0, 0, 1}, {1, 1, 2}, {255, 382, 2}}) {
    std::set<int> experts;
    for (const auto& n : expert_holdings(m, rank, 256).owns) experts.insert(expert_index_of(n));
    EXPECT_EQ(experts.size(), count) << "rank " << rank;
    EXPECT_EQ(*experts.begin(), first) << "rank " << rank;
  }
}

// The layouts plan into a TP-2 / EP-2 replica of the MoE preset, each sender sending only its own.
TEST(TrainerLayouts, MoeLayoutsPlanIntoAnEpReplica) {
  auto model = preset_model("qwen3-30b-a3b");
  ASSERT_TRUE(model.ok());
  const Manifest m = model_manifest(*model);
  auto ranks = model_rank_specs(*model, 1, 2, 2, Scheme::kNone);
  ASSERT_TRUE(ranks.ok()) << ranks.status().to_string();
  for (const char* name : {"fsdp", "hsdp", "pipeline", "ep"}) {
    const auto senders = layout(name, m, 4);
    auto plan = make_plan(m, *ranks, senders);
    ASSERT_TRUE(plan.ok()) << name << ": " << plan.status().to_string();
    ASSERT_EQ(plan->bytes_per_sender.size(), 4u);
    for (int s = 0; s < 4; ++s) EXPECT_GT(plan->bytes_per_sender[static_cast<size_t>(s)], 0u) << name << " sender " << s;
  }
}

}  // namespace
}  // namespace ferry::sharding

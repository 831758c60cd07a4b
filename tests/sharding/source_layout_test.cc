// Megatron-Core's fused tensors as megatron_layout describes them, against Megatron's packing
// written out here from its definition (megatron/core/transformer/attention.py,
// SelfAttention.get_query_key_value_tensors: linear_qkv's outputs, and so its bias, run per query
// group of the rank: the group's query heads, then its key head, then its value head), for the
// qkv biases of Qwen2 and the q/k norms of Qwen3.
#include <array>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "sharding/layout.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/presets.h"
#include "sharding/source_layout.h"

namespace ferry::sharding {
namespace {

ModelConfig small(const char* preset) {
  auto j = nlohmann::json::parse(*preset_text(preset));
  j["hidden_size"] = 128;
  j["num_attention_heads"] = 8;
  j["num_key_value_heads"] = 4;
  j["head_dim"] = 16;
  j["intermediate_size"] = 256;
  j["vocab_size"] = 1000;
  j["num_hidden_layers"] = 2;
  auto c = parse_hf_config(j.dump());
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return *c;
}

using Element = std::pair<std::string, int64_t>;  // checkpoint tensor, element

TEST(MegatronLayout, QkvBiasWhereMegatronPacksIt) {
  const ModelConfig c = small("qwen2-7b");
  ASSERT_TRUE(c.qkv_bias);
  const auto desc = describe_model(c);
  ASSERT_TRUE(desc.ok());
  const Manifest manifest = model_manifest(*desc);
  const int64_t hd = 16, per_group = 2;
  for (int tp : {1, 2, 4}) {
    std::vector<SenderInfo> senders;
    for (int r = 0; r < tp; ++r) {
      auto layout = megatron_layout(c, r, tp);
      ASSERT_TRUE(layout.ok()) << layout.status().to_string();
      senders.push_back(layout_holdings(*layout));
      // Megatron's bias of this rank, element by element.
      const std::string local = "decoder.layers.1.self_attention.linear_qkv.bias";
      std::vector<Element> want;
      for (int64_t g = r * 4 / tp; g < (r + 1) * 4 / tp; ++g) {
        for (int64_t i = 0; i < per_group * hd; ++i) want.emplace_back("model.layers.1.self_attn.q_proj.bias", g * per_group * hd + i);
        for (int64_t i = 0; i < hd; ++i) want.emplace_back("model.layers.1.self_attn.k_proj.bias", g * hd + i);
        for (int64_t i = 0; i < hd; ++i) want.emplace_back("model.layers.1.self_attn.v_proj.bias", g * hd + i);
      }
      std::vector<Element> got(want.size());
      for (const LocalBox& b : layout->boxes) {
        if (b.local != local) continue;
        ASSERT_EQ(b.box.region.rank(), 1) << b.box.name;
        for (int64_t i = 0; i < b.box.region.size[0]; ++i) {
          ASSERT_LT(static_cast<size_t>(b.row + i), got.size()) << b.box.name;
          got[static_cast<size_t>(b.row + i)] = {b.box.name, b.box.region.offset[0] + i};
        }
      }
      EXPECT_EQ(got, want) << "tp " << tp << " rank " << r;
    }
    // Together the ranks hold every tensor exactly (norms and biases included).
    auto held = resolve_holdings(manifest, senders);
    EXPECT_TRUE(held.ok()) << "tp " << tp << ": " << held.status().to_string();
  }
}

TEST(MegatronLayout, QkNormsWholeOnEveryRank) {
  const ModelConfig c = small("qwen3-8b");
  ASSERT_TRUE(c.qk_norm);
  const auto desc = describe_model(c);
  ASSERT_TRUE(desc.ok());
  std::vector<SenderInfo> senders;
  for (int r = 0; r < 2; ++r) {
    auto layout = megatron_layout(c, r, 2);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    std::map<std::string, std::string> local_of;
    for (const LocalBox& b : layout->boxes) {
      if (b.box.name.find("_norm.") != std::string::npos && b.box.name.find("layers.0.self_attn") != std::string::npos) {
        EXPECT_EQ(b.box.region, (Region{{0}, {16}})) << b.box.name;
        EXPECT_EQ(b.row, 0);
        local_of[b.box.name] = b.local;
      }
    }
    EXPECT_EQ(local_of["model.layers.0.self_attn.q_norm.weight"], "decoder.layers.0.self_attention.q_layernorm.weight");
    EXPECT_EQ(local_of["model.layers.0.self_attn.k_norm.weight"], "decoder.layers.0.self_attention.k_layernorm.weight");
    senders.push_back(layout_holdings(*layout));
  }
  EXPECT_TRUE(resolve_holdings(model_manifest(*desc), senders).ok());
  // Shared experts and MLA (DeepSeek-V3, Kimi-K2) are not laid out.
  auto kimi = parse_hf_config(*preset_text("kimi-k2"));
  ASSERT_TRUE(kimi.ok());
  auto refused = megatron_layout(*kimi, 0, 2);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("shared experts"), std::string::npos);
}

// Megatron-Core's rank order "tp-cp-ep-dp-pp" (parallel_state.RankGenerator): within a pipeline
// stage, rank = tp_rank + tp x dp_rank on the dense grid, and etp_rank + etp x (ep_rank + ep x
// edp_rank) on the expert grid.
TEST(MegatronLayout, RanksInMegatronsOrder) {
  for (const auto& [tp, pp, ep, etp] : std::vector<std::array<int, 4>>{{2, 2, 2, 1}, {2, 1, 2, 2}, {1, 2, 4, 1}, {4, 1, 1, 4}}) {
    const int n = 8;
    for (int r = 0; r < n; ++r) {
      int stage = -1;
      auto m = megatron_rank(r, n, tp, pp, ep, etp, &stage);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      const int in_stage = r % (n / pp);
      EXPECT_EQ(stage, r / (n / pp));
      EXPECT_EQ(m->tp_rank, in_stage % tp);
      EXPECT_EQ(m->etp_rank, in_stage % etp);
      EXPECT_EQ(m->ep_rank, in_stage / etp % ep);
    }
  }
  EXPECT_FALSE(megatron_rank(0, 8, 2, 1, 3, 1, nullptr).ok());  // 8 ranks are no EP-3 groups
  EXPECT_FALSE(megatron_rank(0, 6, 2, 2, 1, 1, nullptr).ok());  // nor TP 2 x PP 2
}

// A Qwen3-MoE layer's experts as Megatron-Core holds them (megatron/core/transformer/moe/experts.py,
// TEGroupedMLP.sharded_state_dict: local expert i of EP rank p is global expert p x local + i;
// linear_fc1.weight{i} is column-parallel over the expert-TP group with gated linear units, so it
// holds the rank's rows of gate, then its rows of up; linear_fc2.weight{i} is row-parallel, the
// rank's block of down's columns), its router ([experts, H], whole) and its pre-MLP norm.
TEST(MegatronLayout, ExpertsWhereMegatronHoldsThem) {
  ModelConfig c = small("qwen3-30b-a3b");
  c.num_experts = 8;
  c.moe_intermediate_size = 64;
  ASSERT_TRUE(c.layer_is_moe(1));
  const auto desc = describe_model(c);
  ASSERT_TRUE(desc.ok());
  const Manifest manifest = model_manifest(*desc);
  const int64_t h = 128;
  for (const auto& [tp, ep, etp] : std::vector<std::array<int, 3>>{{2, 2, 1}, {2, 2, 2}, {1, 4, 1}, {2, 1, 2}, {2, 8, 1}}) {
    const int n = std::max(tp, ep * etp);
    std::vector<SenderInfo> senders;
    for (int r = 0; r < n; ++r) {
      auto place = megatron_rank(r, n, tp, 1, ep, etp, nullptr);
      ASSERT_TRUE(place.ok()) << place.status().to_string();
      auto layout = megatron_layout(c, *place);
      ASSERT_TRUE(layout.ok()) << layout.status().to_string();
      senders.push_back(layout_holdings(*layout));
      // What each local expert tensor holds, row by row: (checkpoint tensor, its row), or for fc2
      // (checkpoint tensor, its first column).
      const int64_t local = 8 / ep, mi = 64 / etp;
      std::map<std::string, std::vector<Element>> want, got;
      for (int64_t i = 0; i < local; ++i) {
        const int64_t e = place->ep_rank * local + i;
        const std::string ex = fmt::format("model.layers.1.mlp.experts.{}.", e);
        auto& fc1 = want[fmt::format("decoder.layers.1.mlp.experts.linear_fc1.weight{}", i)];
        for (int64_t j = 0; j < mi; ++j) fc1.emplace_back(ex + "gate_proj.weight", place->etp_rank * mi + j);
        for (int64_t j = 0; j < mi; ++j) fc1.emplace_back(ex + "up_proj.weight", place->etp_rank * mi + j);
        want[fmt::format("decoder.layers.1.mlp.experts.linear_fc2.weight{}", i)] = {{ex + "down_proj.weight", place->etp_rank * mi}};
      }
      for (const LocalBox& b : layout->boxes) {
        if (b.local.find("layers.1.mlp.experts.") == std::string::npos) continue;
        auto& rows = got[b.local];
        if (b.local.find("linear_fc2") != std::string::npos) {
          EXPECT_EQ(b.box.region.size, (Shape{h, mi})) << b.box.name;
          rows.emplace_back(b.box.name, b.box.region.offset[1]);
          continue;
        }
        EXPECT_EQ(b.box.region.size[1], h) << b.box.name;
        rows.resize(static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(rows.size()), b.row + b.box.region.size[0])));
        for (int64_t j = 0; j < b.box.region.size[0]; ++j) rows[static_cast<size_t>(b.row + j)] = {b.box.name, b.box.region.offset[0] + j};
      }
      EXPECT_EQ(got, want) << "tp " << tp << " ep " << ep << " etp " << etp << " rank " << r;
      std::map<std::string, std::string> local_of;
      for (const LocalBox& b : layout->boxes) local_of[b.box.name] = b.local;
      EXPECT_EQ(local_of["model.layers.1.mlp.gate.weight"], "decoder.layers.1.mlp.router.weight");
      EXPECT_EQ(local_of["model.layers.1.post_attention_layernorm.weight"], "decoder.layers.1.pre_mlp_layernorm.weight");
    }
    // Together the ranks hold every tensor exactly.
    auto held = resolve_holdings(manifest, senders);
    EXPECT_TRUE(held.ok()) << "tp " << tp << " ep " << ep << " etp " << etp << ": " << held.status().to_string();
  }
  // Experts that do not split over the EP ranks are refused, naming the sizes.
  auto bad = megatron_layout(c, MegatronRank{2, 0, 3, 0, 1, 0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("8 experts"), std::string::npos) << bad.status().to_string();
}

}  // namespace
}  // namespace ferry::sharding

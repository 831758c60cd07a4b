// Megatron-Core's fused tensors as megatron_layout describes them, against Megatron's packing
// written out here from its definition (megatron/core/transformer/attention.py,
// SelfAttention.get_query_key_value_tensors: linear_qkv's outputs, and so its bias, run per query
// group of the rank: the group's query heads, then its key head, then its value head), for the
// qkv biases of Qwen2 and the q/k norms of Qwen3.
#include <map>
#include <string>
#include <utility>
#include <vector>

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
  // Experts are not Megatron's dense layout.
  auto moe = megatron_layout(small("qwen3-30b-a3b"), 0, 2);
  ASSERT_FALSE(moe.ok());
  EXPECT_NE(moe.status().message().find("mixture-of-experts"), std::string::npos);
}

}  // namespace
}  // namespace ferry::sharding

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

// Megatron-Core's groups under its default order "tp-cp-ep-dp-pp" (parallel_state.RankGenerator,
// the dense grid without ep, the expert grid with expert TP in tp's place), written out for 8 ranks:
// each group's ranks in order, so a rank's index in its group is its rank in that dimension.
TEST(MegatronLayout, RanksInMegatronsOrder) {
  using Groups = std::vector<std::vector<int>>;
  struct Case {
    int tp, pp, ep, etp;
    Groups tp_groups, pp_groups, ep_groups, etp_groups;
  };
  const std::vector<Case> cases = {
      {2,
       2,
       2,
       1,
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
      {2,
       1,
       2,
       2,
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
      {4,
       1,
       4,
       1,
       {{0, 1, 2, 3}, {4, 5, 6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 1, 2, 3}, {4, 5, 6, 7}},
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
      {1,
       2,
       2,
       2,
       {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}},
       {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
       {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
       {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("tp {} pp {} ep {} etp {}", c.tp, c.pp, c.ep, c.etp));
    std::vector<MegatronRank> place(8);
    std::vector<int> stage(8, -1);
    for (int r = 0; r < 8; ++r) {
      auto m = megatron_rank(r, 8, c.tp, c.pp, c.ep, c.etp, &stage[static_cast<size_t>(r)]);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      place[static_cast<size_t>(r)] = *m;
    }
    const auto check = [&](const Groups& groups, auto rank_in) {
      for (const auto& g : groups) {
        for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(rank_in(g[i]), static_cast<int>(i)) << "rank " << g[i];
      }
    };
    check(c.tp_groups, [&](int r) { return place[static_cast<size_t>(r)].tp_rank; });
    check(c.pp_groups, [&](int r) { return stage[static_cast<size_t>(r)]; });
    check(c.ep_groups, [&](int r) { return place[static_cast<size_t>(r)].ep_rank; });
    check(c.etp_groups, [&](int r) { return place[static_cast<size_t>(r)].etp_rank; });
  }
  EXPECT_FALSE(megatron_rank(0, 8, 2, 1, 3, 1, nullptr).ok());  // 8 ranks are no EP-3 groups
  EXPECT_FALSE(megatron_rank(0, 6, 2, 2, 1, 1, nullptr).ok());  // nor TP 2 x PP 2
  EXPECT_FALSE(megatron_rank(8, 8, 2, 1, 1, 1, nullptr).ok());
}

// A Qwen3-MoE layer's experts as Megatron-Core holds them (megatron/core/transformer/moe/experts.py,
// TEGroupedMLP.sharded_state_dict: local expert i of EP rank p is global expert p x local + i;
// linear_fc1.weight{i} is column-parallel over the expert-TP group with gated linear units, so it
// holds the rank's rows of gate, then its rows of up; linear_fc2.weight{i} is row-parallel, the
// rank's block of down's columns), its router ([experts, H], whole) and its pre-MLP norm.
// Mixtral's the same, named block_sparse_moe, w1 (gate), w3 (up) and w2 (down).
TEST(MegatronLayout, ExpertsWhereMegatronHoldsThem) {
  for (const char* preset : {"qwen3-30b-a3b", "mixtral-8x7b"}) {
    SCOPED_TRACE(preset);
    const bool mixtral = std::string(preset) == "mixtral-8x7b";
    const std::string block = mixtral ? "block_sparse_moe" : "mlp";
    const char* gate = mixtral ? "w1" : "gate_proj";
    const char* up = mixtral ? "w3" : "up_proj";
    const char* down = mixtral ? "w2" : "down_proj";
    ModelConfig c = small(preset);
    c.num_experts = 8;
    c.moe_intermediate_size = 64;
    ASSERT_TRUE(c.layer_is_moe(1));
    const auto desc = describe_model(c);
    ASSERT_TRUE(desc.ok());
    const Manifest manifest = model_manifest(*desc);
    const int64_t h = 128;
    for (const auto& [tp, ep, etp] :
         std::vector<std::array<int, 3>>{{2, 2, 1}, {2, 2, 2}, {1, 4, 1}, {2, 1, 2}, {2, 8, 1}}) {
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
          const std::string ex = fmt::format("model.layers.1.{}.experts.{}.", block, e);
          auto& fc1 = want[fmt::format("decoder.layers.1.mlp.experts.linear_fc1.weight{}", i)];
          for (int64_t j = 0; j < mi; ++j) fc1.emplace_back(ex + gate + ".weight", place->etp_rank * mi + j);
          for (int64_t j = 0; j < mi; ++j) fc1.emplace_back(ex + up + ".weight", place->etp_rank * mi + j);
          want[fmt::format("decoder.layers.1.mlp.experts.linear_fc2.weight{}", i)] = {
              {ex + down + ".weight", place->etp_rank * mi}};
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
          rows.resize(
              static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(rows.size()), b.row + b.box.region.size[0])));
          for (int64_t j = 0; j < b.box.region.size[0]; ++j)
            rows[static_cast<size_t>(b.row + j)] = {b.box.name, b.box.region.offset[0] + j};
        }
        EXPECT_EQ(got, want) << "tp " << tp << " ep " << ep << " etp " << etp << " rank " << r;
        std::map<std::string, std::string> local_of;
        for (const LocalBox& b : layout->boxes) local_of[b.box.name] = b.local;
        EXPECT_EQ(local_of["model.layers.1." + block + ".gate.weight"], "decoder.layers.1.mlp.router.weight");
        EXPECT_EQ(local_of["model.layers.1.post_attention_layernorm.weight"],
                  "decoder.layers.1.pre_mlp_layernorm.weight");
      }
      // Together the ranks hold every tensor exactly.
      auto held = resolve_holdings(manifest, senders);
      EXPECT_TRUE(held.ok()) << "tp " << tp << " ep " << ep << " etp " << etp << ": " << held.status().to_string();
    }
    // Experts that do not split over the EP ranks are refused, naming the sizes.
    auto bad = megatron_layout(c, MegatronRank{2, 0, 3, 0, 1, 0});
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("8 experts"), std::string::npos) << bad.status().to_string();
    // The TP-only form takes expert TP = TP, as Megatron does: TP rank 1 of 2 holds the second half
    // of every expert's rows.
    auto tp_only = megatron_layout(c, 1, 2);
    ASSERT_TRUE(tp_only.ok()) << tp_only.status().to_string();
    for (const LocalBox& b : tp_only->boxes) {
      if (b.box.name == fmt::format("model.layers.1.{}.experts.3.{}.weight", block, gate)) {
        EXPECT_EQ(b.box.region, (Region{{32, 0}, {32, h}}));
      }
    }
  }
}

}  // namespace
}  // namespace ferry::sharding

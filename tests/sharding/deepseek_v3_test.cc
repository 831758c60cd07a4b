// DeepSeek-V3 config.json (DeepseekV3ForCausalLM): read, described with the DeepSeek-V3 layout
// (sharding/deepseek_v3.h, the layout of the kimi-k2 preset), laid out over TP / EP and planned,
// also by `ferry plan --config`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/plan_command.h"
#include "sharding/layout.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/presets.h"
#include "tests/sharding/update_fixture.h"

namespace ferry::sharding {
namespace {

// deepseek-ai/DeepSeek-V3's config.json as published (auto_map left out).
constexpr const char* kDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
  "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
  "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
})";

using fixture::find_param;
using fixture::find_source;

// The same config with some keys replaced.
std::string deepseek_v3_with(const nlohmann::json& changes) { return fixture::with_changes(kDeepseekV3, changes); }

TEST(DeepseekV3, ConfigIsRead) {
  auto c = parse_hf_config(kDeepseekV3);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, "deepseek_v3");
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->qk_nope_head_dim, 128);
  EXPECT_EQ(c->qk_rope_head_dim, 64);
  EXPECT_EQ(c->v_head_dim, 128);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->n_shared_experts, 1);
  EXPECT_EQ(c->moe_intermediate_size, 2048);
  EXPECT_FALSE(c->layer_is_moe(2));
  EXPECT_TRUE(c->layer_is_moe(3));
}

TEST(DeepseekV3, ManifestHasTheCheckpointsTensors) {
  auto d = model_from_json(kDeepseekV3);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  // 671B parameters without the multi-token-prediction layer (61), which no rollout engine loads.
  EXPECT_NEAR(static_cast<double>(model_numel(*d)) / 671.0e9, 1.0, 0.01) << model_numel(*d);
  const Manifest m = model_manifest(*d);
  const std::pair<const char*, Shape> shapes[] = {
      {"model.embed_tokens.weight", {129280, 7168}},
      {"model.layers.0.self_attn.q_a_proj.weight", {1536, 7168}},
      {"model.layers.0.self_attn.q_a_layernorm.weight", {1536}},
      {"model.layers.0.self_attn.q_b_proj.weight", {128 * 192, 1536}},
      {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {576, 7168}},
      {"model.layers.0.self_attn.kv_a_layernorm.weight", {512}},
      {"model.layers.0.self_attn.kv_b_proj.weight", {128 * 256, 512}},
      {"model.layers.0.self_attn.o_proj.weight", {7168, 128 * 128}},
      {"model.layers.2.mlp.gate_proj.weight", {18432, 7168}},
      {"model.layers.2.mlp.down_proj.weight", {7168, 18432}},
      {"model.layers.3.mlp.gate.weight", {256, 7168}},
      {"model.layers.3.mlp.gate.e_score_correction_bias", {256}},
      {"model.layers.3.mlp.experts.255.up_proj.weight", {2048, 7168}},
      {"model.layers.60.mlp.experts.0.down_proj.weight", {7168, 2048}},
      {"model.layers.60.mlp.shared_experts.gate_proj.weight", {2048, 7168}},
      {"model.layers.60.mlp.shared_experts.down_proj.weight", {7168, 2048}},
      {"lm_head.weight", {129280, 7168}},
  };
  for (const auto& [name, shape] : shapes) {
    const SourceTensor* t = find_source(m, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype, std::string_view(name).ends_with("e_score_correction_bias") ? DType::kF32 : DType::kBF16);
  }
  // Layers 0..2 are dense, 3..60 sparse; nothing of layer 61 (multi-token prediction).
  EXPECT_EQ(find_source(m, "model.layers.2.mlp.experts.0.gate_proj.weight"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.2.mlp.shared_experts.gate_proj.weight"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.3.mlp.gate_proj.weight"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.61.input_layernorm.weight"), nullptr);
}

// vLLM's layout over TP 8 with EP 8: heads split, q_a / kv_a replicated, experts whole on one rank.
TEST(DeepseekV3, RankOfTp8Ep8) {
  auto d = model_from_json(kDeepseekV3);
  ASSERT_TRUE(d.ok());
  auto r = model_rank_spec(*d, 3, 8, 8, Scheme::kFp8Block);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  struct Want {
    const char* param;
    Shape shape;
    const char* first_source;
    int64_t first_row;  // of the first slice in its source
  };
  const Want want[] = {
      {"model.layers.5.self_attn.q_a_proj.weight", {1536, 7168}, "model.layers.5.self_attn.q_a_proj.weight", 0},
      {"model.layers.5.self_attn.q_b_proj.weight",
       {16 * 192, 1536},
       "model.layers.5.self_attn.q_b_proj.weight",
       3 * 16 * 192},
      {"model.layers.5.self_attn.kv_b_proj.weight",
       {16 * 256, 512},
       "model.layers.5.self_attn.kv_b_proj.weight",
       3 * 16 * 256},
      {"model.layers.5.self_attn.o_proj.weight", {7168, 16 * 128}, "model.layers.5.self_attn.o_proj.weight", 0},
      {"model.layers.5.mlp.experts.w13_weight", {32, 4096, 7168}, "model.layers.5.mlp.experts.96.gate_proj.weight", 0},
      {"model.layers.5.mlp.shared_experts.gate_up_proj.weight",
       {512, 7168},
       "model.layers.5.mlp.shared_experts.gate_proj.weight",
       3 * 256},
      {"model.layers.1.mlp.gate_up_proj.weight",
       {2 * 18432 / 8, 7168},
       "model.layers.1.mlp.gate_proj.weight",
       3 * 18432 / 8},
  };
  for (const auto& w : want) {
    const ParamSpec* p = find_param(*r, w.param);
    ASSERT_NE(p, nullptr) << w.param;
    EXPECT_EQ(p->shape, w.shape) << w.param;
    ASSERT_FALSE(p->slices.empty()) << w.param;
    EXPECT_EQ(p->slices.front().source, w.first_source) << w.param;
    EXPECT_EQ(p->slices.front().src.offset.front(), w.first_row) << w.param;
  }
  // Only this rank's experts are expected from the trainer.
  auto expects = [&](const std::string& n) { return find_source(r->expects, n) != nullptr; };
  EXPECT_TRUE(expects("model.layers.5.mlp.experts.127.down_proj.weight"));
  EXPECT_FALSE(expects("model.layers.5.mlp.experts.128.down_proj.weight"));
}

TEST(DeepseekV3, KimiK2PresetIsTheSameArchitecture) {
  auto kimi = preset_text("kimi-k2");
  ASSERT_TRUE(kimi.ok());
  auto c = parse_hf_config(*kimi);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, "deepseek_v3");
  // Kimi-K2's sizes in DeepSeek-V3's config.json describe the kimi-k2 preset's model.
  auto from_v3 = model_from_json(deepseek_v3_with({{"num_attention_heads", 64},
                                                   {"num_key_value_heads", 64},
                                                   {"n_routed_experts", 384},
                                                   {"first_k_dense_replace", 1},
                                                   {"vocab_size", 163840}}));
  auto preset = preset_model("kimi-k2");
  ASSERT_TRUE(from_v3.ok() && preset.ok());
  EXPECT_EQ(model_manifest(*from_v3), model_manifest(*preset));
  auto a = model_rank_specs(*from_v3, 1, 16, 16, Scheme::kFp8Block);
  auto b = model_rank_specs(*preset, 1, 16, 16, Scheme::kFp8Block);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(plan_key(model_manifest(*preset), *a, {}), plan_key(model_manifest(*preset), *b, {}));
}

TEST(DeepseekV3, SharedExpertsAndTiedEmbeddingsFollowTheConfig) {
  auto d = model_from_json(deepseek_v3_with({{"n_shared_experts", 2}, {"tie_word_embeddings", true}}));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const Manifest m = model_manifest(*d);
  const SourceTensor* shared = find_source(m, "model.layers.3.mlp.shared_experts.up_proj.weight");
  ASSERT_NE(shared, nullptr);
  EXPECT_EQ(shared->shape, (Shape{2 * 2048, 7168}));
  EXPECT_EQ(find_source(m, "lm_head.weight"), nullptr);  // tied: the embedding is sent once
  auto none = model_from_json(deepseek_v3_with({{"n_shared_experts", 0}}));
  ASSERT_TRUE(none.ok()) << none.status().to_string();
  EXPECT_EQ(find_source(model_manifest(*none), "model.layers.3.mlp.shared_experts.up_proj.weight"), nullptr);
}

TEST(DeepseekV3, Refusals) {
  auto message = [](const nlohmann::json& changes) {
    return model_from_json(deepseek_v3_with(changes)).status().message();
  };
  EXPECT_NE(message({{"q_lora_rank", nullptr}}).find("q_lora_rank"), std::string::npos);
  EXPECT_NE(message({{"moe_layer_freq", 2}}).find("moe_layer_freq"), std::string::npos);
  EXPECT_NE(message({{"kv_lora_rank", nullptr}}).find("kv_lora_rank"), std::string::npos);
  EXPECT_NE(message({{"v_head_dim", 0}}).find("MLA"), std::string::npos);
  // Nothing of it splits over TP 3; the error names the first parameter, the embedding, whose padded
  // vocabulary (129280 rows) does not split evenly; and 128 heads do not split over TP 3 either.
  auto d = model_from_json(kDeepseekV3);
  ASSERT_TRUE(d.ok());
  const std::string tp3 = model_rank_spec(*d, 0, 3, 1, Scheme::kFp8Block).status().message();
  EXPECT_NE(tp3.find("model.embed_tokens.weight"), std::string::npos) << tp3;
  EXPECT_NE(tp3.find("129280"), std::string::npos) << tp3;
  auto heads = model_rank_spec(*model_from_json(deepseek_v3_with({{"vocab_size", 129408}})), 0, 3, 1, Scheme::kFp8Block);
  EXPECT_NE(heads.status().message().find("q_b_proj"), std::string::npos) << heads.status().to_string();
}

// `ferry plan --config` with DeepSeek-V3's config.json, as the docs' Kimi-K2 case: 8 replicas of TP 16.
TEST(DeepseekV3, FerryPlanReadsTheConfig) {
  const std::string path = ::testing::TempDir() + "/deepseek_v3_config.json";
  std::ofstream(path) << kDeepseekV3;
  CLI::App app("ferry");
  std::ostringstream out;
  ferry::cli::add_plan_command(app, out);
  std::vector<std::string> argv = {"plan", "--config", path, "--trainers", "256", "--replicas",
                                   "8",    "--tp",     "16", "--ep",       "16",  "--json"};
  std::reverse(argv.begin(), argv.end());  // CLI11 parses a reversed vector
  app.parse(argv);
  std::remove(path.c_str());
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["model"], "deepseek_v3");
  EXPECT_NEAR(j["parameters"].get<double>() / 671.0e9, 1.0, 0.01);
  EXPECT_EQ(j["rollout_gpus"], 128);
  EXPECT_GT(j["predicted_seconds"].get<double>(), 0);
}

}  // namespace
}  // namespace ferry::sharding

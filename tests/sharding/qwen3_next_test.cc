// Qwen3-Next (Qwen3NextForCausalLM): its config.json read, its checkpoint's tensors (as transformers'
// modeling_qwen3_next.py defines them), and each TP rank's tensors against an independent reference
// written from vLLM's loaders (vllm/model_executor/models/qwen3_next.py: QKVParallelLinear over
// 2 x heads for the gated q_proj; the linear-attention layer's column-parallel in_proj_qkvz and
// in_proj_ba, conv1d through mamba_v2_sharded_weight_loader's [q, k, v] sections, A_log and dt_bias
// by sharded_weight_loader(0); FusedMoE's w13 / w2; the shared expert's MergedColumnParallelLinear),
// after an update over real sockets.
#include <gtest/gtest.h>

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sharding/model_config.h"
#include "sharding/presets.h"
#include "tests/sharding/update_fixture.h"

namespace ferry::sharding {
namespace {

using fixture::box_index;
using fixture::element;

// Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the keys that shape its weights, as published).
constexpr const char* kQwen3Next80B = R"({
  "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
  "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
  "intermediate_size": 5120, "vocab_size": 151936, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
  "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "norm_topk_prob": true, "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rms_norm_eps": 1e-06
})";

// Every size scaled down; layer 0 linear attention with experts, layer 1 full attention with a
// dense MLP (mlp_only_layers).
constexpr const char* kTinyQwen3Next = R"({
  "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "intermediate_size": 96, "vocab_size": 100, "tie_word_embeddings": false, "dtype": "bfloat16",
  "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 8,
  "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
  "num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
  "decoder_sparse_step": 1, "mlp_only_layers": [1]
})";

using fixture::find_param;
using fixture::find_source;
using fixture::with_changes;

TEST(Qwen3Next, ConfigIsRead) {
  auto c = parse_hf_config(kQwen3Next80B);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, "qwen3_next");
  EXPECT_EQ(c->linear_num_key_heads, 16);
  EXPECT_EQ(c->linear_num_value_heads, 32);
  EXPECT_EQ(c->linear_key_head_dim, 128);
  EXPECT_EQ(c->linear_value_head_dim, 128);
  EXPECT_EQ(c->linear_conv_kernel_dim, 4);
  EXPECT_EQ(c->shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c->attn_output_gate);
  // Qwen3NextConfig: layer i is full attention when (i + 1) % full_attention_interval == 0.
  for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(c->layer_is_full_attention(i), (i + 1) % 4 == 0) << i;
  for (int64_t i = 0; i < 48; ++i) EXPECT_TRUE(c->layer_is_moe(i)) << i;
}

TEST(Qwen3Next, LayerTypesWhenGivenWin) {
  auto c = parse_hf_config(with_changes(kQwen3Next80B, {{"num_hidden_layers", 3},
                                                {"layer_types", {"full_attention", "linear_attention", "full_attention"}}}));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->layer_is_full_attention(0));
  EXPECT_FALSE(c->layer_is_full_attention(1));
  EXPECT_TRUE(c->layer_is_full_attention(2));
}

TEST(Qwen3Next, BadConfigsNameWhatIsWrong) {
  const std::pair<nlohmann::json, const char*> bad[] = {
      {{{"linear_num_key_heads", nullptr}}, "linear_num_key_heads"},
      {{{"linear_num_value_heads", 24}, {"linear_num_key_heads", 16}}, "linear_num_value_heads"},
      {{{"layer_types", {"full_attention"}}}, "layer_types"},
      {{{"num_hidden_layers", 1}, {"layer_types", {"sliding_attention"}}}, "sliding_attention"},
      {{{"full_attention_interval", 0}}, "full_attention_interval"},
  };
  for (const auto& [change, named] : bad) {
    auto c = parse_hf_config(with_changes(kQwen3Next80B, change));
    ASSERT_FALSE(c.ok()) << change.dump();
    EXPECT_NE(c.status().message().find(named), std::string::npos) << c.status().to_string();
  }
}

// A config built by hand, not parsed, is checked before its layout divides by its key heads.
TEST(Qwen3Next, HandBuiltConfigIsChecked) {
  auto c = parse_hf_config(kQwen3Next80B);
  ASSERT_TRUE(c.ok());
  c->linear_num_key_heads = 0;
  auto d = describe_model(*c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("linear attention"), std::string::npos) << d.status().to_string();
  c->linear_num_key_heads = 12;
  d = describe_model(*c);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("linear_num_value_heads 32"), std::string::npos) << d.status().to_string();
}

TEST(Qwen3Next, ManifestHasTheCheckpointsTensors) {
  auto d = model_from_json(kQwen3Next80B);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  // 80B parameters without the multi-token-prediction tensors, which the main model does not load.
  // embeddings 2 x 151936 x 2048; 36 linear-attention layers of 33,718,464 (qkvz, ba, conv1d, A_log,
  // dt_bias, norm, out_proj), 12 full-attention ones of 27,263,488, 48 MoE blocks of 1,614,809,088 (512
  // experts, router, shared expert and its gate), 2 norms per layer and the final one.
  EXPECT_EQ(model_numel(*d), 79674391296);
  const Manifest m = model_manifest(*d);
  const std::pair<const char*, Shape> shapes[] = {
      {"model.embed_tokens.weight", {151936, 2048}},
      {"model.layers.0.linear_attn.in_proj_qkvz.weight", {2 * 16 * 128 + 2 * 32 * 128, 2048}},
      {"model.layers.0.linear_attn.in_proj_ba.weight", {64, 2048}},
      {"model.layers.0.linear_attn.conv1d.weight", {2 * 16 * 128 + 32 * 128, 1, 4}},
      {"model.layers.0.linear_attn.dt_bias", {32}},
      {"model.layers.0.linear_attn.A_log", {32}},
      {"model.layers.0.linear_attn.norm.weight", {128}},
      {"model.layers.0.linear_attn.out_proj.weight", {2048, 32 * 128}},
      {"model.layers.3.self_attn.q_proj.weight", {16 * 256 * 2, 2048}},
      {"model.layers.3.self_attn.k_proj.weight", {2 * 256, 2048}},
      {"model.layers.3.self_attn.v_proj.weight", {2 * 256, 2048}},
      {"model.layers.3.self_attn.o_proj.weight", {2048, 16 * 256}},
      {"model.layers.3.self_attn.q_norm.weight", {256}},
      {"model.layers.47.mlp.gate.weight", {512, 2048}},
      {"model.layers.47.mlp.experts.511.up_proj.weight", {512, 2048}},
      {"model.layers.47.mlp.experts.0.down_proj.weight", {2048, 512}},
      {"model.layers.47.mlp.shared_expert.gate_proj.weight", {512, 2048}},
      {"model.layers.47.mlp.shared_expert.down_proj.weight", {2048, 512}},
      {"model.layers.47.mlp.shared_expert_gate.weight", {1, 2048}},
      {"lm_head.weight", {151936, 2048}},
  };
  for (const auto& [name, shape] : shapes) {
    const SourceTensor* t = find_source(m, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, shape) << name;
    EXPECT_EQ(t->dtype, DType::kBF16) << name;
  }
  EXPECT_EQ(find_source(m, "model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.3.linear_attn.A_log"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.0.mlp.gate_proj.weight"), nullptr);
  EXPECT_EQ(find_source(m, "model.layers.48.input_layernorm.weight"), nullptr);
}

// vLLM's per-rank shapes at TP 4.
TEST(Qwen3Next, RankOfTp4) {
  auto d = model_from_json(kQwen3Next80B);
  ASSERT_TRUE(d.ok());
  auto r = model_rank_spec(*d, 3, 4, 1, Scheme::kFp8Block);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const std::pair<const char*, Shape> shapes[] = {
      {"model.layers.3.self_attn.qkv_proj.weight", {2048 + 256 + 256, 2048}},
      {"model.layers.3.self_attn.o_proj.weight", {2048, 1024}},
      {"model.layers.0.linear_attn.in_proj_qkvz.weight", {3072, 2048}},
      {"model.layers.0.linear_attn.in_proj_ba.weight", {16, 2048}},
      {"model.layers.0.linear_attn.conv1d.weight", {512 + 512 + 1024, 1, 4}},
      {"model.layers.0.linear_attn.A_log", {8}},
      {"model.layers.0.linear_attn.dt_bias", {8}},
      {"model.layers.0.linear_attn.out_proj.weight", {2048, 1024}},
      {"model.layers.0.mlp.experts.w13_weight", {512, 256, 2048}},
      {"model.layers.0.mlp.experts.w2_weight", {512, 2048, 128}},
      {"model.layers.0.mlp.shared_expert.gate_up_proj.weight", {256, 2048}},
      {"model.layers.0.mlp.shared_expert.down_proj.weight", {2048, 128}},
      {"model.embed_tokens.weight", {37984, 2048}},
  };
  for (const auto& [name, shape] : shapes) {
    const ParamSpec* p = find_param(*r, name);
    ASSERT_NE(p, nullptr) << name;
    EXPECT_EQ(p->shape, shape) << name;
  }
  EXPECT_EQ(find_param(*r, "model.layers.0.linear_attn.in_proj_qkvz.weight")->scheme, Scheme::kFp8Block);
  EXPECT_EQ(find_param(*r, "model.layers.0.linear_attn.conv1d.weight")->scheme, Scheme::kNone);
  EXPECT_EQ(find_param(*r, "model.layers.0.linear_attn.in_proj_ba.weight")->scheme, Scheme::kNone);
}

// The TP sizes a layout cannot split are refused, naming the tensor.
TEST(Qwen3Next, TpThatSplitsAKeyHeadGroupIsRefused) {
  auto d = model_from_json(kQwen3Next80B);
  ASSERT_TRUE(d.ok());
  auto r = model_rank_spec(*d, 0, 32, 1, Scheme::kNone);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("in_proj_qkvz"), std::string::npos) << r.status().to_string();
}

// A box of a checkpoint tensor, appended to the reference in row-major order.
struct Part {
  std::string source;
  Region box;
};

Region rows(const Shape& shape, int64_t first, int64_t n) {
  Region r = Region::whole(shape);
  r.offset[0] = first;
  r.size[0] = n;
  return r;
}

Region cols(const Shape& shape, int64_t first, int64_t n) {
  Region r = Region::whole(shape);
  r.offset[1] = first;
  r.size[1] = n;
  return r;
}

// vLLM's tensor `name` on rank r of T, as the checkpoint boxes it concatenates along its first
// dimension (experts first for w13 / w2), from vLLM's loaders; what follows them (vocab padding) is
// not compared.
std::vector<Part> vllm_parts(const std::string& name, const ModelConfig& c, const Manifest& m, int64_t T, int64_t r) {
  auto shape = [&](const std::string& n) { return find_source(m, n)->shape; };
  auto split_rows = [&](const std::string& n) {
    const Shape s = shape(n);
    return Part{n, rows(s, r * s[0] / T, s[0] / T)};
  };
  auto split_cols = [&](const std::string& n) {
    const Shape s = shape(n);
    return Part{n, cols(s, r * s[1] / T, s[1] / T)};
  };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
    const int64_t padded = (c.vocab_size + 63) / 64 * 64, per = padded / T;  // pad_vocab_size(V, 64) / T
    const int64_t first = std::min(c.vocab_size, r * per), last = std::min(c.vocab_size, (r + 1) * per);
    return {Part{name, rows(shape(name), first, last - first)}};
  }
  const size_t dot = name.find('.', std::string("model.layers.").size());
  const std::string layer = name.substr(0, dot + 1), rest = name.substr(dot + 1);
  if (rest == "self_attn.qkv_proj.weight") {
    const int64_t d = c.effective_head_dim(), kv = c.num_kv_heads;
    const int64_t kv_heads = kv >= T ? kv / T : 1, kv_head0 = kv >= T ? r * kv_heads : r / (T / kv);
    const std::string a = layer + "self_attn.";
    return {split_rows(a + "q_proj.weight"), Part{a + "k_proj.weight", rows(shape(a + "k_proj.weight"), kv_head0 * d, kv_heads * d)},
            Part{a + "v_proj.weight", rows(shape(a + "v_proj.weight"), kv_head0 * d, kv_heads * d)}};
  }
  if (rest == "linear_attn.conv1d.weight") {
    const std::string n = layer + rest;
    const int64_t kd = c.linear_num_key_heads * c.linear_key_head_dim, vd = c.linear_num_value_heads * c.linear_value_head_dim;
    const Shape s = shape(n);
    return {Part{n, rows(s, r * kd / T, kd / T)}, Part{n, rows(s, kd + r * kd / T, kd / T)},
            Part{n, rows(s, 2 * kd + r * vd / T, vd / T)}};
  }
  if (rest == "linear_attn.in_proj_qkvz.weight" || rest == "linear_attn.in_proj_ba.weight" ||
      rest == "linear_attn.A_log" || rest == "linear_attn.dt_bias") {
    return {split_rows(layer + rest)};
  }
  if (rest == "self_attn.o_proj.weight" || rest == "linear_attn.out_proj.weight" ||
      rest == "mlp.shared_expert.down_proj.weight" || rest == "mlp.down_proj.weight") {
    return {split_cols(layer + rest)};
  }
  if (rest == "mlp.shared_expert.gate_up_proj.weight") {
    return {split_rows(layer + "mlp.shared_expert.gate_proj.weight"), split_rows(layer + "mlp.shared_expert.up_proj.weight")};
  }
  if (rest == "mlp.gate_up_proj.weight") return {split_rows(layer + "mlp.gate_proj.weight"), split_rows(layer + "mlp.up_proj.weight")};
  if (rest == "mlp.experts.w13_weight" || rest == "mlp.experts.w2_weight") {
    std::vector<Part> parts;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string ex = fmt::format("{}mlp.experts.{}.", layer, e);
      if (rest == "mlp.experts.w13_weight") {
        parts.push_back(split_rows(ex + "gate_proj.weight"));
        parts.push_back(split_rows(ex + "up_proj.weight"));
      } else {
        parts.push_back(split_cols(ex + "down_proj.weight"));
      }
    }
    return parts;
  }
  return {Part{name, Region::whole(shape(name))}};  // replicated: norms, router, shared_expert_gate
}

class Qwen3NextUpdate : public ::testing::TestWithParam<int> {};

TEST_P(Qwen3NextUpdate, EveryRankHoldsWhatVllmLoads) {
  const int tp = GetParam();
  auto config = parse_hf_config(kTinyQwen3Next);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  auto model = model_from_json(kTinyQwen3Next);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const Manifest manifest = model_manifest(*model);
  fixture::Replica replica;
  const Status started = replica.start(*model, tp, 1, Scheme::kNone);
  ASSERT_TRUE(started.ok()) << started.to_string();
  for (uint32_t version : {1, 2}) {
    const fixture::Weights w(manifest, version);
    auto report = replica.update(version, manifest, w);
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->moved, 0u);
    int checked = 0;
    for (int r = 0; r < tp; ++r) {
      for (const ParamSpec& p : replica.specs[static_cast<size_t>(r)].params) {
        auto stored = replica.storage[static_cast<size_t>(r)]->get(p.name);
        ASSERT_TRUE(stored.ok()) << p.name;
        int64_t at = 0;
        for (const Part& part : vllm_parts(p.name, *config, manifest, tp, r)) {
          const TensorView& src = w.views.at(part.source);
          for (int64_t k = 0; k < part.box.numel(); ++k, ++at) {
            ASSERT_EQ(element(*stored, at), element(src, box_index(src.shape(), part.box, k)))
                << "rank " << r << " " << p.name << " element " << at << " from " << part.source << " " << part.box.to_string();
          }
        }
        // The reference covers every element, but a vocabulary shard's padding rows.
        const bool vocab = p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight";
        ASSERT_TRUE(vocab ? at <= stored->numel() : at == stored->numel())
            << p.name << ": the reference covers " << at << " of " << stored->numel();
        ++checked;
      }
    }
    EXPECT_GT(checked, 20 * tp);
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, Qwen3NextUpdate, ::testing::Values(1, 2, 4));

// Quantized: every linear layer under fp8 (per channel, and 128 x 128 blocks), the census at 0.
TEST(Qwen3NextUpdate, Fp8UpdatesComplete) {
  auto model = model_from_json(kTinyQwen3Next);
  ASSERT_TRUE(model.ok());
  const Manifest manifest = model_manifest(*model);
  for (Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kFp8Block}) {
    fixture::Replica replica;
    const Status started = replica.start(*model, 2, 1, scheme);
    ASSERT_TRUE(started.ok()) << started.to_string();
    auto report = replica.update(1, manifest, fixture::Weights(manifest));
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->moved, 0u);
    EXPECT_GT(report->registered, 0u);
  }
}

}  // namespace
}  // namespace ferry::sharding

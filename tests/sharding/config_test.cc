// config.json parsing for each family, presets, and the mapping-file format.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sharding/layout.h"
#include "sharding/mapping.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/presets.h"

namespace ferry::sharding {
namespace {

bool has_source(const ModelDesc& d, const std::string& name) {
  for (const auto& t : model_manifest(d)) {
    if (t.name == name) return true;
  }
  return false;
}

// The element of `list` (a manifest, a rank's params) called `name`, or null: callers assert it is
// there before they look at it, so an expectation about a missing tensor fails instead of vanishing.
template <typename List>
const typename List::value_type* find_named(const List& list, const std::string& name) {
  for (const auto& x : list) {
    if (x.name == name) return &x;
  }
  return nullptr;
}

TEST(HfConfig, Llama) {
  auto c = parse_hf_config(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 2,
    "tie_word_embeddings": true, "torch_dtype": "float16", "rope_theta": 500000.0})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->effective_head_dim(), 8);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->dtype, DType::kF16);
  auto d = describe_model(*c);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(has_source(*d, "lm_head.weight"));  // tied
  ASSERT_FALSE(d->params.back().sources.empty());
  EXPECT_EQ(d->params.back().sources[0], "model.embed_tokens.weight");
}

TEST(HfConfig, MistralDefaultsKvHeadsAndDtype) {
  auto c = parse_hf_config(R"({"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 8,
    "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->dtype, DType::kBF16);
}

TEST(HfConfig, Qwen2HasQkvBias) {
  auto c = parse_hf_config(R"({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qkv_bias);
  auto d = describe_model(*c);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(has_source(*d, "model.layers.0.self_attn.k_proj.bias"));
}

TEST(HfConfig, Qwen3HasQkNormAndExplicitHeadDim) {
  auto c = parse_hf_config(R"({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->effective_head_dim(), 16);
  auto d = describe_model(*c);
  ASSERT_TRUE(d.ok());
  const auto m = model_manifest(*d);
  const auto* q = find_named(m, "model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (Shape{128, 64}));  // 8 heads of head_dim 16, not hidden / heads = 8
  EXPECT_NE(find_named(m, "model.layers.0.self_attn.q_norm.weight"), nullptr);
  EXPECT_NE(find_named(m, "model.layers.0.self_attn.k_norm.weight"), nullptr);
}

TEST(HfConfig, Qwen3MoeExpertsAndDenseLayers) {
  auto c = parse_hf_config(R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1], "vocab_size": 100, "num_hidden_layers": 2})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->layer_is_moe(0));
  EXPECT_FALSE(c->layer_is_moe(1));
  auto d = describe_model(*c);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(has_source(*d, "model.layers.0.mlp.experts.3.down_proj.weight"));
  EXPECT_TRUE(has_source(*d, "model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(has_source(*d, "model.layers.1.mlp.gate_proj.weight"));
  auto rank = model_rank_spec(*d, 1, 2, 2, Scheme::kFp8PerChannel);
  ASSERT_TRUE(rank.ok()) << rank.status().to_string();
  // EP 2 over TP 2: rank 1 holds experts 2 and 3 whole, and takes no tensor of experts 0 and 1.
  const auto* w13 = find_named(rank->params, "model.layers.0.mlp.experts.w13_weight");
  const auto* w2 = find_named(rank->params, "model.layers.0.mlp.experts.w2_weight");
  ASSERT_NE(w13, nullptr);
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w13->shape, (Shape{2, 64, 64}));
  EXPECT_EQ(w2->shape, (Shape{2, 64, 32}));
  for (const char* w : {"gate_proj", "up_proj", "down_proj"}) {
    for (int e = 0; e < 4; ++e) {
      const std::string name = "model.layers.0.mlp.experts." + std::to_string(e) + "." + w + ".weight";
      EXPECT_EQ(find_named(rank->expects, name) != nullptr, e >= 2) << name;
    }
  }
}

TEST(HfConfig, MixtralExpertNames) {
  auto c = parse_hf_config(R"({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 32, "num_local_experts": 4, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->moe_intermediate_size, 32);
  auto d = describe_model(*c);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(has_source(*d, "model.layers.0.block_sparse_moe.experts.2.w3.weight"));
  EXPECT_TRUE(has_source(*d, "model.layers.0.block_sparse_moe.gate.weight"));
}

TEST(HfConfig, Errors) {
  EXPECT_EQ(parse_hf_config("{not json").status().code(), StatusCode::kInvalidArgument);
  auto missing = parse_hf_config(R"({"model_type": "llama", "hidden_size": 64})");
  EXPECT_NE(missing.status().message().find("num_attention_heads"), std::string::npos);
  auto family = parse_hf_config(R"({"model_type": "gpt_neox"})");
  EXPECT_NE(family.status().message().find("gpt_neox"), std::string::npos);
  auto mistyped = parse_hf_config(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
    "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1, "tie_word_embeddings": "yes"})");
  EXPECT_EQ(mistyped.status().code(), StatusCode::kInvalidArgument);
  auto dtype = parse_hf_config(R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
    "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1, "torch_dtype": "int8"})");
  EXPECT_EQ(dtype.status().code(), StatusCode::kInvalidArgument);
}

// transformers >= 4.56 writes "dtype" instead of "torch_dtype"; the dtype is the manifest's.
TEST(HfConfig, DtypeKeyIsRead) {
  constexpr const char* kBody = R"("model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128, "vocab_size": 100,
    "num_hidden_layers": 1)";
  auto with = [&](const std::string& keys) { return "{" + std::string(kBody) + keys + "}"; };
  for (const auto& [name, dt] :
       std::vector<std::pair<std::string, DType>>{{"float16", DType::kF16}, {"float32", DType::kF32}}) {
    auto c = parse_hf_config(with(R"(, "dtype": ")" + name + "\""));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->dtype, dt) << name;
    auto d = model_from_json(with(R"(, "dtype": ")" + name + "\""));
    ASSERT_TRUE(d.ok());
    for (const auto& t : model_manifest(*d)) EXPECT_EQ(t.dtype, dt) << t.name;
  }
  auto both = parse_hf_config(with(R"(, "dtype": "float16", "torch_dtype": "float16")"));
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->dtype, DType::kF16);
  auto differ = parse_hf_config(with(R"(, "dtype": "float16", "torch_dtype": "bfloat16")"));
  EXPECT_EQ(differ.status().code(), StatusCode::kInvalidArgument);
  auto odd = parse_hf_config(with(R"(, "dtype": "int8")"));
  EXPECT_NE(odd.status().message().find("int8"), std::string::npos);
  auto none = parse_hf_config(with(""));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->dtype, DType::kBF16);
}

// The architecture names the family; one without a built-in layout is refused, naming it and the way
// to describe it (a mapping file, given where the config.json went).
TEST(HfConfig, UnknownArchitectureNamesItAndTheMappingFile) {
  auto c = parse_hf_config(R"({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64,
    "num_attention_heads": 8, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  const std::string m = c.status().message();
  for (const char* want : {"GPTNeoXForCausalLM", "ferry_mapping", "--config", "DeepseekV3ForCausalLM"}) {
    EXPECT_NE(m.find(want), std::string::npos) << want << " not in: " << m;
  }
  // A known architecture is read whatever its model_type (Kimi-K2's is kimi_k2).
  auto kimi = parse_hf_config(R"({"architectures": ["LlamaForCausalLM"], "model_type": "some_llama", "hidden_size": 64,
    "num_attention_heads": 8, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 1})");
  ASSERT_TRUE(kimi.ok()) << kimi.status().to_string();
  EXPECT_EQ(kimi->family, "llama");
}

TEST(Presets, ParameterCountsMatchThePublishedModels) {
  const std::pair<const char*, double> expected[] = {{"llama2-7b", 6.74e9},     {"llama3-8b", 8.03e9},
                                                     {"llama3-70b", 70.55e9},   {"mistral-7b", 7.25e9},
                                                     {"qwen2-7b", 7.62e9},      {"qwen3-8b", 8.19e9},
                                                     {"qwen3-30b-a3b", 30.53e9}, {"mixtral-8x7b", 46.70e9},
                                                     {"llama3.2-1b", 1.24e9},   {"kimi-k2", 1.027e12}};
  for (const auto& [name, params] : expected) {
    auto d = preset_model(name);
    ASSERT_TRUE(d.ok()) << name << ": " << d.status().to_string();
    const double n = static_cast<double>(model_numel(*d));
    EXPECT_NEAR(n / params, 1.0, 0.01) << name << " has " << n;
  }
  EXPECT_EQ(preset_model("gpt-5").status().code(), StatusCode::kNotFound);
}

TEST(Presets, KimiK2LaysOutOverTp16Ep16) {
  auto d = preset_model("kimi-k2");
  ASSERT_TRUE(d.ok());
  auto r = model_rank_spec(*d, 5, 16, 16, Scheme::kFp8Block);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto* w13 = find_named(r->params, "model.layers.7.mlp.experts.w13_weight");
  ASSERT_NE(w13, nullptr);
  EXPECT_EQ(w13->shape, (Shape{24, 4096, 7168}));
  ASSERT_FALSE(w13->slices.empty());
  EXPECT_EQ(w13->slices.front().source, "model.layers.7.mlp.experts.120.gate_proj.weight");
  const auto* q_b = find_named(r->params, "model.layers.7.self_attn.q_b_proj.weight");
  ASSERT_NE(q_b, nullptr);
  EXPECT_EQ(q_b->shape, (Shape{768, 1536}));
}

constexpr const char* kTinyMapping = R"({
  "ferry_mapping": 1, "name": "tiny", "dtype": "bf16",
  "vars": {"H": 64, "V": 100, "I": 128},
  "params": [
    {"param": "model.embed_tokens.weight", "layout": "vocab_parallel", "shape": ["V", "H"], "pad_multiple": 64},
    {"param": "model.layers.{L}.input_layernorm.weight", "layers": [0, 2], "layout": "replicated", "shape": ["H"]},
    {"param": "model.layers.{L}.self_attn.qkv_proj.weight", "layers": [0, 2], "layout": "qkv",
     "num_heads": 8, "num_kv_heads": 2, "head_dim": 8,
     "sources": ["model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
                 "model.layers.{L}.self_attn.v_proj.weight"], "shapes": [[64, "H"], [16, "H"], [16, "H"]]},
    {"param": "model.layers.{L}.self_attn.o_proj.weight", "layers": [0, 2], "layout": "row", "shape": ["H", 64]},
    {"param": "model.layers.{L}.post_attention_layernorm.weight", "layers": [0, 2], "layout": "replicated", "shape": ["H"]},
    {"param": "model.layers.{L}.mlp.gate_up_proj.weight", "layers": [0, 2], "layout": "merged_column",
     "sources": ["model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"], "shape": ["I", "H"]},
    {"param": "model.layers.{L}.mlp.down_proj.weight", "layers": [0, 2], "layout": "row", "shape": ["H", "I"]},
    {"param": "model.norm.weight", "layout": "replicated", "shape": ["H"]},
    {"param": "lm_head.weight", "layout": "vocab_parallel", "source": "model.embed_tokens.weight", "shape": ["V", "H"],
     "pad_multiple": 64}
  ]})";

TEST(Mapping, TinyMappingEqualsTheBuiltInLlamaLayout) {
  auto mapped = parse_mapping(kTinyMapping);
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  ModelConfig c;
  c.family = "llama";
  c.hidden_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.intermediate_size = 128;
  c.vocab_size = 100;
  c.num_layers = 2;
  c.tie_word_embeddings = true;
  auto built = describe_model(c);
  ASSERT_TRUE(built.ok());
  EXPECT_EQ(model_manifest(*mapped), model_manifest(*built));
  for (int tp : {1, 2, 4}) {
    auto a = model_rank_specs(*mapped, 1, tp, 1, Scheme::kFp8PerChannel);
    auto b = model_rank_specs(*built, 1, tp, 1, Scheme::kFp8PerChannel);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(plan_key(model_manifest(*mapped), *a, {}), plan_key(model_manifest(*built), *b, {})) << "tp " << tp;
  }
}

TEST(Mapping, FileOrConfigAreToldApart) {
  EXPECT_TRUE(looks_like_mapping(kTinyMapping));
  EXPECT_FALSE(looks_like_mapping(R"({"model_type": "llama"})"));
  auto m = model_from_json(kTinyMapping);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->name, "tiny");
}

TEST(Mapping, Errors) {
  auto err = [](const char* text) { return parse_mapping(text).status(); };
  EXPECT_NE(err(R"({"params": []})").message().find("ferry_mapping"), std::string::npos);
  EXPECT_NE(err(R"({"ferry_mapping": 1, "params": [], "extra": 1})").message().find("extra"), std::string::npos);
  EXPECT_NE(err(R"({"ferry_mapping": 1, "params": [{"param": "a.weight", "layout": "diagonal", "shape": [4]}]})")
                .message()
                .find("diagonal"),
            std::string::npos);
  EXPECT_NE(err(R"({"ferry_mapping": 1, "params": [{"param": "a.weight", "layout": "row", "shape": ["X", 4]}]})")
                .message()
                .find("X"),
            std::string::npos);
  EXPECT_NE(err(R"({"ferry_mapping": 1, "params": [{"param": "l.{L}.w", "layout": "row", "shape": [4, 4]}]})")
                .message()
                .find("{L}"),
            std::string::npos);
  EXPECT_NE(err(R"({"ferry_mapping": 1, "params": [{"param": "a.weight", "layout": "row", "shape": [4, 4], "unit": 2,
                  "quantise": true}]})")
                .message()
                .find("quantise"),
            std::string::npos);
  EXPECT_EQ(err(R"({"ferry_mapping": 1, "name": 5, "params": []})").code(), StatusCode::kInvalidArgument);
  // Layout errors surface when the model is laid out, naming the parameter.
  auto odd = parse_mapping(R"({"ferry_mapping": 1, "params": [{"param": "w.weight", "layout": "column", "shape": [6, 4]}]})");
  ASSERT_TRUE(odd.ok());
  auto spec = model_rank_spec(*odd, 0, 4, 1, Scheme::kNone);
  EXPECT_NE(spec.status().message().find("w.weight"), std::string::npos);
}

// A mapping's "stacked" key: the experts of each layer held in one tensor of the trainer's own name,
// expanded per layer as the rule is; it equals stack_experts() on the same model where the names
// agree, and bad uses are refused naming the parameter and what was written.
TEST(Mapping, StackedExperts) {
  constexpr const char* kMoe = R"({"ferry_mapping": 1, "vars": {"H": 16}, "params": [
    {"param": "model.layers.{L}.mlp.experts.w13_weight", "layers": [0, 2], "layout": "experts", "split": "column",
     "num_experts": 4, "shapes": [[8, "H"], [8, "H"]], "stacked": "model.layers.{L}.moe.w13",
     "sources": ["model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"]},
    {"param": "model.layers.{L}.mlp.experts.w2_weight", "layers": [0, 2], "layout": "experts", "split": "row",
     "num_experts": 4, "shape": ["H", 8], "sources": ["model.layers.{L}.mlp.experts.{E}.down_proj.weight"]}]})";
  auto m = parse_mapping(kMoe);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const Manifest manifest = model_manifest(*m);
  ASSERT_EQ(manifest.size(), 2u + 2u * 4u);  // two stacked w13, and w2 per expert
  EXPECT_EQ(manifest[0].name, "model.layers.0.moe.w13");
  EXPECT_EQ(manifest[0].shape, (Shape{4, 16, 16}));
  ASSERT_TRUE(stack_experts(*m).ok());  // w13 keeps its name; w2 gets transformers' down_proj
  const Manifest both = model_manifest(*m);
  EXPECT_EQ(both.size(), 4u);
  EXPECT_EQ(both[1].name, "model.layers.0.mlp.experts.down_proj");
  EXPECT_EQ(both[1].shape, (Shape{4, 16, 8}));
  auto spec = model_rank_spec(*m, 1, 2, 2, Scheme::kNone);  // EP 2: experts 2 and 3, whole
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec->params[0].slices.size(), 1u);
  EXPECT_EQ(spec->params[0].slices[0].src, (Region{{2, 0, 0}, {2, 16, 16}}));

  auto err = [](std::string_view rule) {
    return parse_mapping(fmt::format(R"({{"ferry_mapping": 1, "params": [{}]}})", rule)).status().message();
  };
  EXPECT_THAT(err(R"({"param": "w", "layout": "experts", "num_experts": 2, "shape": [4, 4],
                     "sources": ["e.{E}.w"], "stacked": ""})"),
              ::testing::HasSubstr("\"stacked\" must name"));
  EXPECT_THAT(err(R"({"param": "w", "layout": "row", "shape": [4, 4], "stacked": "s"})"),
              ::testing::HasSubstr("not \"row\""));
  EXPECT_THAT(err(R"({"param": "w", "layout": "experts", "num_experts": 2, "shape": [4, 4],
                     "sources": ["e.{E}.w"], "stacked": "l.{L}.s"})"),
              ::testing::HasSubstr("{L}"));
  auto twice = parse_mapping(R"({"ferry_mapping": 1, "params": [
    {"param": "a", "layout": "experts", "num_experts": 2, "shape": [4, 4], "sources": ["a.{E}"], "stacked": "s"},
    {"param": "b", "layout": "experts", "num_experts": 2, "shape": [4, 4], "sources": ["b.{E}"], "stacked": "s"}]})");
  ASSERT_TRUE(twice.ok());
  EXPECT_THAT(model_rank_spec(*twice, 0, 1, 1, Scheme::kNone).status().message(), ::testing::HasSubstr("used twice"));
  // A column-split rule of one source is not transformers' gate_up_proj: stack_experts says so.
  ModelDesc one;
  ParamRule r;
  r.param = "x";
  r.layout = Layout::kExperts;
  r.sources = {"e.{E}.w"};
  r.shapes = {{4, 4}};
  r.num_experts = 2;
  one.params.push_back(r);
  EXPECT_THAT(stack_experts(one).message(), ::testing::HasSubstr("1 source(s), split column"));
}

}  // namespace
}  // namespace ferry::sharding

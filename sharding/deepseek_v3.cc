#include "sharding/deepseek_v3.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sharding/mapping.h"

namespace ferry::sharding {
namespace {

// Engine names as vLLM's DeepseekV2/V3 model loads them. MLA: q_a and kv_a projections replicated,
// q_b split by heads (QU = nope + rope rows per head), kv_b split by heads (KVU = nope k + v rows per
// head), o_proj row-parallel; layers [0, FD) dense, [FD, NL) with E routed experts (fused w13 / w2)
// and SI = shared experts x MI rows of shared expert.
constexpr const char* kParams = R"([
  {"param": "model.embed_tokens.weight", "layout": "vocab_parallel", "shape": ["V", "H"], "pad_multiple": 64},
  {"param": "model.layers.{L}.input_layernorm.weight", "layers": [0, "NL"], "layout": "replicated", "shape": ["H"]},
  {"param": "model.layers.{L}.self_attn.q_a_proj.weight", "layers": [0, "NL"], "layout": "replicated",
   "quantize": true, "shape": ["QL", "H"]},
  {"param": "model.layers.{L}.self_attn.q_a_layernorm.weight", "layers": [0, "NL"], "layout": "replicated",
   "shape": ["QL"]},
  {"param": "model.layers.{L}.self_attn.q_b_proj.weight", "layers": [0, "NL"], "layout": "column", "unit": "QU",
   "shape": ["QB", "QL"]},
  {"param": "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight", "layers": [0, "NL"], "layout": "replicated",
   "quantize": true, "shape": ["KVA", "H"]},
  {"param": "model.layers.{L}.self_attn.kv_a_layernorm.weight", "layers": [0, "NL"], "layout": "replicated",
   "shape": ["KVL"]},
  {"param": "model.layers.{L}.self_attn.kv_b_proj.weight", "layers": [0, "NL"], "layout": "column", "unit": "KVU",
   "shape": ["KVB", "KVL"]},
  {"param": "model.layers.{L}.self_attn.o_proj.weight", "layers": [0, "NL"], "layout": "row", "shape": ["H", "O"]},
  {"param": "model.layers.{L}.post_attention_layernorm.weight", "layers": [0, "NL"], "layout": "replicated",
   "shape": ["H"]},
  {"param": "model.layers.{L}.mlp.gate_up_proj.weight", "layers": [0, "FD"], "layout": "merged_column",
   "sources": ["model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"], "shape": ["DI", "H"]},
  {"param": "model.layers.{L}.mlp.down_proj.weight", "layers": [0, "FD"], "layout": "row", "shape": ["H", "DI"]},
  {"param": "model.layers.{L}.mlp.gate.weight", "layers": ["FD", "NL"], "layout": "replicated", "shape": ["E", "H"]},
  {"param": "model.layers.{L}.mlp.gate.e_score_correction_bias", "layers": ["FD", "NL"], "layout": "replicated",
   "dtype": "f32", "shape": ["E"]},
  {"param": "model.layers.{L}.mlp.experts.w13_weight", "layers": ["FD", "NL"], "layout": "experts", "split": "column",
   "num_experts": "E", "shape": ["MI", "H"],
   "sources": ["model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"]},
  {"param": "model.layers.{L}.mlp.experts.w2_weight", "layers": ["FD", "NL"], "layout": "experts", "split": "row",
   "num_experts": "E", "shape": ["H", "MI"], "source": "model.layers.{L}.mlp.experts.{E}.down_proj.weight"},
  {"param": "model.layers.{L}.mlp.shared_experts.gate_up_proj.weight", "layers": ["FD", "NL"],
   "layout": "merged_column", "shape": ["SI", "H"],
   "sources": ["model.layers.{L}.mlp.shared_experts.gate_proj.weight",
               "model.layers.{L}.mlp.shared_experts.up_proj.weight"]},
  {"param": "model.layers.{L}.mlp.shared_experts.down_proj.weight", "layers": ["FD", "NL"], "layout": "row",
   "shape": ["H", "SI"]},
  {"param": "model.norm.weight", "layout": "replicated", "shape": ["H"]},
  {"param": "lm_head.weight", "layout": "vocab_parallel", "shape": ["V", "H"], "pad_multiple": 64}
])";

}  // namespace

Result<ModelDesc> describe_deepseek_v3(const ModelConfig& c) {
  using json = nlohmann::json;
  const int64_t heads = c.num_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  // Layers [FD, NL) are sparse (ModelConfig::layer_is_moe with moe_layer_freq 1).
  const int64_t dense = c.num_experts > 0 ? std::min(c.first_k_dense_replace, c.num_layers) : c.num_layers;
  json vars = {{"H", c.hidden_size},
               {"V", c.vocab_size},
               {"QL", c.q_lora_rank},
               {"QU", nope + rope},
               {"QB", heads * (nope + rope)},
               {"KVL", c.kv_lora_rank},
               {"KVA", c.kv_lora_rank + rope},
               {"KVU", nope + c.v_head_dim},
               {"KVB", heads * (nope + c.v_head_dim)},
               {"O", heads * c.v_head_dim},
               {"DI", c.intermediate_size},
               {"MI", c.moe_intermediate_size},
               {"SI", c.moe_intermediate_size * c.n_shared_experts},
               {"E", c.num_experts},
               {"NL", c.num_layers},
               {"FD", dense}};
  json params = json::parse(kParams);
  if (c.n_shared_experts == 0) {
    params.erase(std::remove_if(params.begin(), params.end(),
                                [](const json& p) {
                                  return p["param"].get<std::string>().find(".shared_experts.") != std::string::npos;
                                }),
                 params.end());
  }
  if (c.tie_word_embeddings) params.back()["source"] = "model.embed_tokens.weight";
  const json mapping = {{"ferry_mapping", 1},
                        {"name", c.family},
                        {"dtype", std::string(dtype_name(c.dtype))},
                        {"vars", std::move(vars)},
                        {"params", std::move(params)}};
  return parse_mapping(mapping.dump());
}

}  // namespace ferry::sharding

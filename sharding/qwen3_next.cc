#include "sharding/qwen3_next.h"

#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sharding/mapping.h"

namespace ferry::sharding {
namespace {

using json = nlohmann::json;

// One mapping entry of layer `i` (its name's "{L}" replaced).
json entry(int64_t i, std::string_view param, json fields) {
  fields["param"] = fmt::format("model.layers.{}.{}", i, param);
  return fields;
}

// Gated full attention (Qwen3NextAttention): q_proj holds, per head, the query's head_dim rows then
// the output gate's, so vLLM's QKVParallelLinear counts 2 x num_attention_heads heads of head_dim.
void full_attention(int64_t i, json& params) {
  const std::string q = fmt::format("model.layers.{}.self_attn.", i);
  params.push_back(entry(i, "self_attn.qkv_proj.weight",
                         {{"layout", "qkv"},
                          {"sources", {q + "q_proj.weight", q + "k_proj.weight", q + "v_proj.weight"}},
                          {"shapes", json::array({json::array({"QR", "H"}), json::array({"KVR", "H"}), json::array({"KVR", "H"})})},
                          {"num_heads", "QH"},
                          {"num_kv_heads", "KVH"},
                          {"head_dim", "D"}}));
  params.push_back(entry(i, "self_attn.q_norm.weight", {{"layout", "replicated"}, {"shape", {"D"}}}));
  params.push_back(entry(i, "self_attn.k_norm.weight", {{"layout", "replicated"}, {"shape", {"D"}}}));
  params.push_back(entry(i, "self_attn.o_proj.weight", {{"layout", "row"}, {"shape", {"H", "O"}}}));
}

// Gated DeltaNet (Qwen3NextGatedDeltaNet): in_proj_qkvz rows grouped by key head ([q, k, v, z] of
// each, G rows) and in_proj_ba likewise ([b, a], BA rows), split in whole groups; conv1d's channels
// are [q | k | v], each section split over TP; A_log and dt_bias one value per value head.
void linear_attention(int64_t i, json& params) {
  params.push_back(entry(i, "linear_attn.in_proj_qkvz.weight",
                         {{"layout", "column"}, {"unit", "G"}, {"shape", {"QKVZ", "H"}}}));
  params.push_back(entry(i, "linear_attn.in_proj_ba.weight",
                         {{"layout", "column"}, {"unit", "BA"}, {"quantize", false}, {"shape", {"NBA", "H"}}}));
  params.push_back(entry(i, "linear_attn.conv1d.weight",
                         {{"layout", "merged_column"},
                          {"sections", {"KD", "KD", "VD"}},
                          {"quantize", false},
                          {"shape", {"CD", 1, "K"}}}));
  params.push_back(entry(i, "linear_attn.dt_bias", {{"layout", "column"}, {"quantize", false}, {"shape", {"NV"}}}));
  params.push_back(entry(i, "linear_attn.A_log", {{"layout", "column"}, {"quantize", false}, {"shape", {"NV"}}}));
  params.push_back(entry(i, "linear_attn.norm.weight", {{"layout", "replicated"}, {"shape", {"DV"}}}));
  params.push_back(entry(i, "linear_attn.out_proj.weight", {{"layout", "row"}, {"shape", {"H", "VD"}}}));
}

void experts(int64_t i, const ModelConfig& c, json& params) {
  const std::string ex = fmt::format("model.layers.{}.mlp.experts.{{E}}.", i);
  params.push_back(entry(i, "mlp.gate.weight", {{"layout", "replicated"}, {"shape", {"E", "H"}}}));
  params.push_back(entry(i, "mlp.experts.w13_weight",
                         {{"layout", "experts"},
                          {"split", "column"},
                          {"num_experts", "E"},
                          {"shape", {"MI", "H"}},
                          {"sources", {ex + "gate_proj.weight", ex + "up_proj.weight"}}}));
  params.push_back(entry(i, "mlp.experts.w2_weight",
                         {{"layout", "experts"},
                          {"split", "row"},
                          {"num_experts", "E"},
                          {"shape", {"H", "MI"}},
                          {"source", ex + "down_proj.weight"}}));
  if (c.shared_expert_intermediate_size <= 0) return;
  const std::string se = fmt::format("model.layers.{}.mlp.shared_expert.", i);
  params.push_back(entry(i, "mlp.shared_expert.gate_up_proj.weight",
                         {{"layout", "merged_column"},
                          {"sources", {se + "gate_proj.weight", se + "up_proj.weight"}},
                          {"shape", {"SI", "H"}}}));
  params.push_back(entry(i, "mlp.shared_expert.down_proj.weight", {{"layout", "row"}, {"shape", {"H", "SI"}}}));
  params.push_back(entry(i, "mlp.shared_expert_gate.weight", {{"layout", "replicated"}, {"shape", {1, "H"}}}));
}

void dense_mlp(int64_t i, json& params) {
  const std::string m = fmt::format("model.layers.{}.mlp.", i);
  params.push_back(entry(i, "mlp.gate_up_proj.weight",
                         {{"layout", "merged_column"},
                          {"sources", {m + "gate_proj.weight", m + "up_proj.weight"}},
                          {"shape", {"DI", "H"}}}));
  params.push_back(entry(i, "mlp.down_proj.weight", {{"layout", "row"}, {"shape", {"H", "DI"}}}));
}

}  // namespace

Status check_qwen3_next(const ModelConfig& c) {
  if (c.linear_num_key_heads <= 0 || c.linear_num_value_heads <= 0 || c.linear_key_head_dim <= 0 ||
      c.linear_value_head_dim <= 0 || c.linear_conv_kernel_dim <= 0 || c.shared_expert_intermediate_size < 0) {
    return Status::invalid_argument("config.json: linear attention sizes must be positive");
  }
  if (c.linear_num_value_heads % c.linear_num_key_heads) {
    return Status::invalid_argument(fmt::format("config.json: linear_num_value_heads {} is not a multiple of "
                                                "linear_num_key_heads {}",
                                                c.linear_num_value_heads, c.linear_num_key_heads));
  }
  return ok_status();
}

Result<ModelDesc> describe_qwen3_next(const ModelConfig& c) {
  FERRY_RETURN_IF_ERROR(check_qwen3_next(c));
  const int64_t d = c.effective_head_dim(), nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t kd = nk * dk, vd = nv * dv, per_key_head = nv / nk;  // value heads per key head
  const int64_t q_heads = c.attn_output_gate ? 2 * c.num_heads : c.num_heads;
  const json vars = {{"H", c.hidden_size},
                     {"V", c.vocab_size},
                     {"D", d},
                     {"QH", q_heads},
                     {"QR", q_heads * d},
                     {"KVH", c.num_kv_heads},
                     {"KVR", c.num_kv_heads * d},
                     {"O", c.num_heads * d},
                     {"G", 2 * dk + 2 * per_key_head * dv},
                     {"QKVZ", 2 * kd + 2 * vd},
                     {"BA", 2 * per_key_head},
                     {"NBA", 2 * nv},
                     {"KD", kd},
                     {"VD", vd},
                     {"CD", 2 * kd + vd},
                     {"K", c.linear_conv_kernel_dim},
                     {"NV", nv},
                     {"DV", dv},
                     {"DI", c.intermediate_size},
                     {"MI", c.moe_intermediate_size},
                     {"SI", c.shared_expert_intermediate_size},
                     {"E", c.num_experts}};
  json params = json::array();
  params.push_back({{"param", "model.embed_tokens.weight"},
                    {"layout", "vocab_parallel"},
                    {"shape", {"V", "H"}},
                    {"pad_multiple", c.vocab_pad_multiple}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    params.push_back(entry(i, "input_layernorm.weight", {{"layout", "replicated"}, {"shape", {"H"}}}));
    if (c.layer_is_full_attention(i)) {
      full_attention(i, params);
    } else {
      linear_attention(i, params);
    }
    params.push_back(entry(i, "post_attention_layernorm.weight", {{"layout", "replicated"}, {"shape", {"H"}}}));
    if (c.layer_is_moe(i)) {
      experts(i, c, params);
    } else {
      dense_mlp(i, params);
    }
  }
  params.push_back({{"param", "model.norm.weight"}, {"layout", "replicated"}, {"shape", {"H"}}});
  params.push_back({{"param", "lm_head.weight"},
                    {"layout", "vocab_parallel"},
                    {"shape", {"V", "H"}},
                    {"pad_multiple", c.vocab_pad_multiple},
                    {"source", c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"}});
  const json mapping = {{"ferry_mapping", 1},
                        {"name", c.family},
                        {"dtype", std::string(dtype_name(c.dtype))},
                        {"vars", vars},
                        {"params", std::move(params)}};
  return parse_mapping(mapping.dump());
}

}  // namespace ferry::sharding

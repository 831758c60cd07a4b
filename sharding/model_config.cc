#include "sharding/model_config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ferry::sharding {
namespace {

using json = nlohmann::json;

Result<int64_t> get_int(const json& j, const char* key, int64_t fallback, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return Status::invalid_argument(fmt::format("config.json: missing \"{}\"", key));
    return fallback;
  }
  if (!it->is_number_integer()) return Status::invalid_argument(fmt::format("config.json: \"{}\" is not an integer", key));
  return it->get<int64_t>();
}

Result<DType> parse_torch_dtype(const json& j) {
  auto it = j.find("torch_dtype");
  if (it == j.end() || it->is_null()) return DType::kBF16;
  if (!it->is_string()) return Status::invalid_argument("config.json: \"torch_dtype\" is not a string");
  const std::string s = it->get<std::string>();
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16") return DType::kF16;
  if (s == "float32") return DType::kF32;
  return Status::invalid_argument(fmt::format("config.json: torch_dtype {} is not a training dtype ferry takes", s));
}

std::string lname(int64_t i, std::string_view rest) { return fmt::format("model.layers.{}.{}", i, rest); }

ParamRule rule(std::string param, Layout layout, std::vector<std::string> sources, std::vector<Shape> shapes, DType dt,
               bool quantize) {
  ParamRule r;
  r.param = std::move(param);
  r.layout = layout;
  r.sources = std::move(sources);
  r.shapes = std::move(shapes);
  r.dtype = dt;
  r.quantize = quantize;
  return r;
}

ParamRule same(const std::string& name, Layout layout, Shape shape, DType dt, bool quantize) {
  return rule(name, layout, {name}, {std::move(shape)}, dt, quantize);
}

}  // namespace

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return decoder_sparse_step <= 1 || (layer + 1) % decoder_sparse_step == 0;
}

Result<ModelConfig> parse_config_json(std::string_view text);

Result<ModelConfig> parse_hf_config(std::string_view text) {
  // nlohmann's typed getters throw on a mistyped value; no exception leaves this function.
  try {
    return parse_config_json(text);
  } catch (const json::exception& e) {
    return Status::invalid_argument(fmt::format("config.json: {}", e.what()));
  }
}

Result<ModelConfig> parse_config_json(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::invalid_argument("config.json: not a JSON object");
  ModelConfig c;
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) return Status::invalid_argument("config.json: missing \"model_type\"");
  c.family = mt->get<std::string>();
  static const char* kFamilies[] = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"};
  if (std::find(std::begin(kFamilies), std::end(kFamilies), c.family) == std::end(kFamilies)) {
    return Status::invalid_argument(fmt::format(
        "config.json: model_type {} has no preset layout; describe it with a mapping file (docs/cost_model.md)", c.family));
  }
  FERRY_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_heads, get_int(j, "num_attention_heads", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_kv_heads, get_int(j, "num_key_value_heads", c.num_heads, false));
  FERRY_ASSIGN_OR_RETURN(c.head_dim, get_int(j, "head_dim", 0, false));
  FERRY_ASSIGN_OR_RETURN(c.intermediate_size, get_int(j, "intermediate_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.dtype, parse_torch_dtype(j));
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.qkv_bias = c.family == "qwen2" || j.value("attention_bias", false);
  c.qk_norm = c.family == "qwen3" || c.family == "qwen3_moe";
  if (c.family == "qwen3_moe") {
    FERRY_ASSIGN_OR_RETURN(c.num_experts, get_int(j, "num_experts", 0, true));
    FERRY_ASSIGN_OR_RETURN(c.moe_intermediate_size, get_int(j, "moe_intermediate_size", 0, true));
    FERRY_ASSIGN_OR_RETURN(c.decoder_sparse_step, get_int(j, "decoder_sparse_step", 1, false));
    if (auto it = j.find("mlp_only_layers"); it != j.end() && it->is_array()) {
      for (const auto& v : *it) {
        if (!v.is_number_integer()) return Status::invalid_argument("config.json: mlp_only_layers holds a non-integer");
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  } else if (c.family == "mixtral") {
    FERRY_ASSIGN_OR_RETURN(c.num_experts, get_int(j, "num_local_experts", 0, true));
    c.moe_intermediate_size = c.intermediate_size;
  }
  if (c.hidden_size <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 || c.vocab_size <= 0 || c.num_layers < 0 ||
      c.intermediate_size <= 0 || c.head_dim < 0) {
    return Status::invalid_argument("config.json: sizes must be positive");
  }
  if (c.num_experts < 0 || (c.num_experts > 0 && c.moe_intermediate_size <= 0)) {
    return Status::invalid_argument("config.json: expert sizes must be positive");
  }
  return c;
}

Result<ModelConfig> load_hf_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found(fmt::format("cannot open {}", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto r = parse_hf_config(ss.str());
  if (!r.ok()) return r.status().with_context(path);
  return r;
}

Status ModelConfig::validate(int tp_size) const {
  if (hidden_size <= 0 || num_heads <= 0 || num_kv_heads <= 0 || intermediate_size <= 0 || vocab_size <= 0 ||
      num_layers < 0) {
    return Status::invalid_argument("llama config: sizes must be positive");
  }
  if (tp_size <= 0) return Status::invalid_argument("tp size must be positive");
  if (num_heads % num_kv_heads) return Status::invalid_argument("llama config: heads not a multiple of kv heads");
  if (num_heads % tp_size) {
    return Status::invalid_argument(fmt::format("{} attention heads do not split over TP {}", num_heads, tp_size));
  }
  if (num_kv_heads >= tp_size ? num_kv_heads % tp_size : tp_size % num_kv_heads) {
    return Status::invalid_argument(fmt::format("{} KV heads do not split over TP {}", num_kv_heads, tp_size));
  }
  if (intermediate_size % tp_size) {
    return Status::invalid_argument(fmt::format("intermediate size {} does not split over TP {}", intermediate_size, tp_size));
  }
  if (vocab_pad_multiple <= 0) return Status::invalid_argument("vocab_pad_multiple must be positive");
  return ok_status();
}

Result<ModelDesc> describe_model(const ModelConfig& c) {
  if (c.num_heads <= 0 || c.hidden_size <= 0) return Status::invalid_argument("model config: sizes must be positive");
  const int64_t h = c.hidden_size, hd = c.effective_head_dim();
  const DType dt = c.dtype;
  ModelDesc m;
  m.name = c.family;
  ParamRule embed = same("model.embed_tokens.weight", Layout::kVocabParallel, {c.vocab_size, h}, dt, false);
  embed.pad_multiple = c.vocab_pad_multiple;
  m.params.push_back(embed);
  const bool mixtral = c.family == "mixtral";
  for (int64_t i = 0; i < c.num_layers; ++i) {
    m.params.push_back(same(lname(i, "input_layernorm.weight"), Layout::kReplicated, {h}, dt, false));
    for (const char* kind : {"weight", "bias"}) {
      const bool bias = std::string_view(kind) == "bias";
      if (bias && !c.qkv_bias) continue;
      auto shape = [&](int64_t heads) { return bias ? Shape{heads * hd} : Shape{heads * hd, h}; };
      ParamRule qkv = rule(lname(i, fmt::format("self_attn.qkv_proj.{}", kind)), Layout::kQkv,
                           {lname(i, fmt::format("self_attn.q_proj.{}", kind)), lname(i, fmt::format("self_attn.k_proj.{}", kind)),
                            lname(i, fmt::format("self_attn.v_proj.{}", kind))},
                           {shape(c.num_heads), shape(c.num_kv_heads), shape(c.num_kv_heads)}, dt, !bias);
      qkv.num_heads = c.num_heads;
      qkv.num_kv_heads = c.num_kv_heads;
      qkv.head_dim = hd;
      m.params.push_back(std::move(qkv));
    }
    if (c.qk_norm) {
      m.params.push_back(same(lname(i, "self_attn.q_norm.weight"), Layout::kReplicated, {hd}, dt, false));
      m.params.push_back(same(lname(i, "self_attn.k_norm.weight"), Layout::kReplicated, {hd}, dt, false));
    }
    m.params.push_back(same(lname(i, "self_attn.o_proj.weight"), Layout::kRow, {h, c.num_heads * hd}, dt, true));
    m.params.push_back(same(lname(i, "post_attention_layernorm.weight"), Layout::kReplicated, {h}, dt, false));
    if (!c.layer_is_moe(i)) {
      const int64_t inter = c.intermediate_size;
      m.params.push_back(rule(lname(i, "mlp.gate_up_proj.weight"), Layout::kMergedColumn,
                              {lname(i, "mlp.gate_proj.weight"), lname(i, "mlp.up_proj.weight")}, {{inter, h}, {inter, h}}, dt,
                              true));
      m.params.push_back(same(lname(i, "mlp.down_proj.weight"), Layout::kRow, {h, inter}, dt, true));
      continue;
    }
    const int64_t mi = c.moe_intermediate_size;
    const std::string block = mixtral ? "block_sparse_moe" : "mlp";
    m.params.push_back(same(lname(i, block + ".gate.weight"), Layout::kReplicated, {c.num_experts, h}, dt, false));
    const std::string ex = lname(i, block + ".experts.{E}.");
    ParamRule w13 = rule(lname(i, block + ".experts.w13_weight"), Layout::kExperts,
                         mixtral ? std::vector<std::string>{ex + "w1.weight", ex + "w3.weight"}
                                 : std::vector<std::string>{ex + "gate_proj.weight", ex + "up_proj.weight"},
                         {{mi, h}, {mi, h}}, dt, true);
    w13.num_experts = c.num_experts;
    w13.expert_split = Layout::kColumn;
    ParamRule w2 = rule(lname(i, block + ".experts.w2_weight"), Layout::kExperts,
                        {ex + (mixtral ? "w2.weight" : "down_proj.weight")}, {{h, mi}}, dt, true);
    w2.num_experts = c.num_experts;
    w2.expert_split = Layout::kRow;
    m.params.push_back(std::move(w13));
    m.params.push_back(std::move(w2));
  }
  m.params.push_back(same("model.norm.weight", Layout::kReplicated, {h}, dt, false));
  ParamRule head = rule("lm_head.weight", Layout::kVocabParallel,
                        {c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"}, {{c.vocab_size, h}}, dt, false);
  head.pad_multiple = c.vocab_pad_multiple;
  m.params.push_back(std::move(head));
  return m;
}

}  // namespace ferry::sharding

#include "sharding/model_config.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sharding/deepseek_v3.h"
#include "sharding/qwen3_next.h"

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

// transformers writes "dtype" since 4.56 and "torch_dtype" before; a config may hold either or both.
Result<DType> parse_dtype_key(const json& j) {
  std::optional<DType> found;
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string()) return Status::invalid_argument(fmt::format("config.json: \"{}\" is not a string", key));
    const std::string s = it->get<std::string>();
    DType dt;
    if (s == "bfloat16") {
      dt = DType::kBF16;
    } else if (s == "float16") {
      dt = DType::kF16;
    } else if (s == "float32") {
      dt = DType::kF32;
    } else {
      return Status::invalid_argument(fmt::format("config.json: {} {} is not a training dtype ferry takes", key, s));
    }
    if (found && *found != dt) {
      return Status::invalid_argument("config.json: \"dtype\" and \"torch_dtype\" name different dtypes");
    }
    found = dt;
  }
  return found.value_or(DType::kBF16);
}

// Hugging Face architecture -> family. Without "architectures" the model_type names the family.
constexpr std::pair<std::string_view, std::string_view> kArchitectures[] = {
    {"LlamaForCausalLM", "llama"},
    {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"},
    {"MixtralForCausalLM", "mixtral"},
    {"DeepseekV3ForCausalLM", "deepseek_v3"},
    {"Qwen3NextForCausalLM", "qwen3_next"},
};

Status no_layout(std::string_view what, std::string_view name) {
  std::string known;
  for (const auto& [arch, family] : kArchitectures) known += (known.empty() ? "" : ", ") + std::string(arch);
  return Status::invalid_argument(fmt::format(
      "config.json: {} {} has no built-in layout (built in: {}); describe its tensors in a mapping file, a JSON "
      "object with \"ferry_mapping\": 1, \"vars\" and one \"params\" entry per engine parameter (layout, sources, "
      "shapes; docs/cost_model.md, \"Mapping files\"), and pass that file where the config.json went "
      "(ferry plan --config FILE, ferry.model_from_file)",
      what, name, known));
}

Result<std::string> family_of(const json& j) {
  if (auto a = j.find("architectures"); a != j.end() && !a->is_null()) {
    if (!a->is_array() || a->empty() || !(*a)[0].is_string()) {
      return Status::invalid_argument("config.json: \"architectures\" is not a list of names");
    }
    const std::string arch = (*a)[0].get<std::string>();
    for (const auto& [name, family] : kArchitectures) {
      if (name == arch) return std::string(family);
    }
    return no_layout("architecture", arch);
  }
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) return Status::invalid_argument("config.json: missing \"model_type\"");
  const std::string type = mt->get<std::string>();
  for (const auto& [name, family] : kArchitectures) {
    if (family == type) return type;
  }
  return no_layout("model_type", type);
}

Status parse_deepseek_v3(const json& j, ModelConfig* c) {
  auto q = j.find("q_lora_rank");
  if (q == j.end() || q->is_null()) {
    return Status::invalid_argument(
        "config.json: q_lora_rank null (a plain q_proj, as DeepSeek-V2-Lite) has no built-in "
        "layout; describe it in a mapping file (docs/cost_model.md, \"Mapping files\")");
  }
  FERRY_ASSIGN_OR_RETURN(c->q_lora_rank, get_int(j, "q_lora_rank", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->kv_lora_rank, get_int(j, "kv_lora_rank", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->qk_nope_head_dim, get_int(j, "qk_nope_head_dim", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->qk_rope_head_dim, get_int(j, "qk_rope_head_dim", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->v_head_dim, get_int(j, "v_head_dim", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->num_experts, get_int(j, "n_routed_experts", 0, false));
  FERRY_ASSIGN_OR_RETURN(c->moe_intermediate_size, get_int(j, "moe_intermediate_size", 0, c->num_experts > 0));
  FERRY_ASSIGN_OR_RETURN(c->n_shared_experts, get_int(j, "n_shared_experts", 0, false));
  FERRY_ASSIGN_OR_RETURN(c->first_k_dense_replace, get_int(j, "first_k_dense_replace", 0, false));
  FERRY_ASSIGN_OR_RETURN(const int64_t freq, get_int(j, "moe_layer_freq", 1, false));
  if (freq != 1) {
    return Status::invalid_argument(fmt::format(
        "config.json: moe_layer_freq {} (dense layers between sparse ones) has no built-in layout; describe it in a "
        "mapping file (docs/cost_model.md, \"Mapping files\")",
        freq));
  }
  if (c->q_lora_rank <= 0 || c->kv_lora_rank <= 0 || c->qk_nope_head_dim <= 0 || c->qk_rope_head_dim <= 0 ||
      c->v_head_dim <= 0 || c->n_shared_experts < 0 || c->first_k_dense_replace < 0) {
    return Status::invalid_argument("config.json: MLA sizes must be positive");
  }
  return ok_status();
}

// Qwen3NextConfig's keys (transformers' configuration_qwen3_next.py): the Gated DeltaNet sizes, the
// layer types, the shared expert; the routed experts as Qwen3-MoE's.
Status parse_qwen3_next(const json& j, ModelConfig* c) {
  FERRY_ASSIGN_OR_RETURN(c->linear_num_key_heads, get_int(j, "linear_num_key_heads", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->linear_num_value_heads, get_int(j, "linear_num_value_heads", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->linear_key_head_dim, get_int(j, "linear_key_head_dim", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->linear_value_head_dim, get_int(j, "linear_value_head_dim", 0, true));
  FERRY_ASSIGN_OR_RETURN(c->linear_conv_kernel_dim, get_int(j, "linear_conv_kernel_dim", 4, false));
  FERRY_ASSIGN_OR_RETURN(const int64_t interval, get_int(j, "full_attention_interval", 4, false));
  FERRY_ASSIGN_OR_RETURN(c->shared_expert_intermediate_size, get_int(j, "shared_expert_intermediate_size", 0, false));
  c->attn_output_gate = j.value("attn_output_gate", true);
  FERRY_RETURN_IF_ERROR(check_qwen3_next(*c));
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != c->num_layers) {
      return Status::invalid_argument(
          fmt::format("config.json: layer_types must name each of the {} layers", c->num_layers));
    }
    for (const auto& t : *it) {
      const std::string type = t.is_string() ? t.get<std::string>() : t.dump();
      if (type != "full_attention" && type != "linear_attention") {
        return Status::invalid_argument(fmt::format(
            "config.json: layer_types holds {}; Qwen3-Next layers are full_attention or linear_attention", type));
      }
      c->full_attention_layers.push_back(type == "full_attention");
    }
    return ok_status();
  }
  // Qwen3NextConfig without layer_types: every interval-th layer is full attention.
  if (interval <= 0) {
    return Status::invalid_argument(fmt::format("config.json: full_attention_interval {} must be positive", interval));
  }
  for (int64_t i = 0; i < c->num_layers; ++i) c->full_attention_layers.push_back((i + 1) % interval == 0);
  return ok_status();
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

bool ModelConfig::layer_is_full_attention(int64_t layer) const {
  if (full_attention_layers.empty()) return true;
  return layer >= 0 && layer < static_cast<int64_t>(full_attention_layers.size()) &&
         full_attention_layers[static_cast<size_t>(layer)];
}

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (num_experts <= 0 || layer < first_k_dense_replace) return false;
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
  FERRY_ASSIGN_OR_RETURN(c.family, family_of(j));
  FERRY_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_heads, get_int(j, "num_attention_heads", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_kv_heads, get_int(j, "num_key_value_heads", c.num_heads, false));
  FERRY_ASSIGN_OR_RETURN(c.head_dim, get_int(j, "head_dim", 0, false));
  FERRY_ASSIGN_OR_RETURN(c.intermediate_size, get_int(j, "intermediate_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", 0, true));
  FERRY_ASSIGN_OR_RETURN(c.dtype, parse_dtype_key(j));
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.qkv_bias = c.family == "qwen2" || j.value("attention_bias", false);
  c.qk_norm = c.family == "qwen3" || c.family == "qwen3_moe" || c.family == "qwen3_next";
  if (c.family == "qwen3_moe" || c.family == "qwen3_next") {
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
  } else if (c.family == "deepseek_v3") {
    FERRY_RETURN_IF_ERROR(parse_deepseek_v3(j, &c));
  }
  if (c.family == "qwen3_next") FERRY_RETURN_IF_ERROR(parse_qwen3_next(j, &c));
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
  if (c.family == "deepseek_v3") return describe_deepseek_v3(c);
  if (c.family == "qwen3_next") return describe_qwen3_next(c);
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

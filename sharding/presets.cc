#include "sharding/presets.h"

#include <fstream>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "sharding/mapping.h"
#include "sharding/model_config.h"

namespace ferry::sharding {
namespace {

// Sizes as published in each model's config.json.
constexpr std::pair<std::string_view, std::string_view> kPresets[] = {
    {"llama2-7b", R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
      "intermediate_size": 11008, "vocab_size": 32000, "num_hidden_layers": 32, "torch_dtype": "float16"})"},
    {"llama3-8b", R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
      "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "torch_dtype": "bfloat16"})"},
    {"llama3-70b", R"({"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
      "intermediate_size": 28672, "vocab_size": 128256, "num_hidden_layers": 80, "torch_dtype": "bfloat16"})"},
    {"llama3.2-1b", R"({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "num_hidden_layers": 16,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16"})"},
    {"mistral-7b", R"({"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
      "intermediate_size": 14336, "vocab_size": 32768, "num_hidden_layers": 32, "torch_dtype": "bfloat16"})"},
    {"qwen2-7b", R"({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
      "intermediate_size": 18944, "vocab_size": 152064, "num_hidden_layers": 28, "torch_dtype": "bfloat16"})"},
    {"qwen3-8b", R"({"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "num_hidden_layers": 36,
      "torch_dtype": "bfloat16"})"},
    {"qwen3-30b-a3b", R"({"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
      "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
      "vocab_size": 151936, "num_hidden_layers": 48, "torch_dtype": "bfloat16"})"},
    {"mixtral-8x7b", R"({"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
      "intermediate_size": 14336, "num_local_experts": 8, "vocab_size": 32000, "num_hidden_layers": 32,
      "torch_dtype": "bfloat16"})"},
    // Qwen3-Next-80B-A3B (sharding/qwen3_next.h): 36 Gated DeltaNet layers and 12 gated full-attention
    // ones (every fourth), each with 512 routed experts and a shared expert.
    {"qwen3-next-80b-a3b", R"({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
      "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
      "intermediate_size": 5120, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 512,
      "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
      "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "num_hidden_layers": 48,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
    // Kimi-K2: DeepSeek-V3 architecture (sharding/deepseek_v3.h): MLA attention, layer 0 dense, layers
    // 1..60 with 384 routed experts and one shared expert.
    {"kimi-k2", R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
      "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1, "first_k_dense_replace": 1,
      "moe_layer_freq": 1, "vocab_size": 163840, "num_hidden_layers": 61, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16"})"},
};

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const auto& [n, t] : kPresets) out.emplace_back(n);
  return out;
}

Result<std::string> preset_text(std::string_view name) {
  for (const auto& [n, t] : kPresets) {
    if (n == name) return std::string(t);
  }
  std::string known;
  for (const auto& [n, t] : kPresets) known += (known.empty() ? "" : ", ") + std::string(n);
  return Status::not_found(fmt::format("no preset model {}; presets: {}", name, known));
}

Result<ModelDesc> model_from_json(std::string_view text) {
  if (looks_like_mapping(text)) return parse_mapping(text);
  FERRY_ASSIGN_OR_RETURN(ModelConfig cfg, parse_hf_config(text));
  return describe_model(cfg);
}

Result<ModelDesc> preset_model(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(std::string text, preset_text(name));
  auto m = model_from_json(text);
  if (!m.ok()) return m.status().with_context(fmt::format("preset {}", name));
  if (m->name.empty() || m->name == "custom" || !looks_like_mapping(text)) m->name = std::string(name);
  return m;
}

Result<ModelDesc> model_from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found(fmt::format("cannot open {}", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto m = model_from_json(ss.str());
  if (!m.ok()) return m.status().with_context(path);
  return m;
}

}  // namespace ferry::sharding

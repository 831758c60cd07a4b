// A model's shape, parsed from a Hugging Face style config.json or set by hand (LlamaConfig,
// sharding/llama.h): Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), the
// mixture-of-experts families Qwen3-MoE and Mixtral, and DeepSeek-V3 (MLA attention, shared experts:
// DeepSeek-V3/R1, Kimi-K2; sharding/deepseek_v3.h), and Qwen3-Next (Gated DeltaNet linear attention
// between gated full-attention layers, routed and shared experts; sharding/qwen3_next.h). The family
// comes from "architectures" (else
// "model_type"); anything else is refused, pointing at mapping files (sharding/mapping.h). Each
// becomes a ModelDesc in the engine's fused naming (qkv_proj, gate_up_proj, experts.w13_weight / w2_weight).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "sharding/layout.h"

namespace ferry::sharding {

struct ModelConfig {
  std::string family;  // llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3, qwen3_next
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // 0: hidden_size / num_heads
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  bool qk_norm = false;
  DType dtype = DType::kBF16;  // "dtype", or the older "torch_dtype"
  int64_t vocab_pad_multiple = 64;
  // Mixture of experts (num_experts > 0).
  int64_t num_experts = 0;
  int64_t moe_intermediate_size = 0;  // per expert
  int64_t decoder_sparse_step = 1;    // Qwen3-MoE: layer i is sparse when (i + 1) % step == 0
  std::vector<int64_t> mlp_only_layers;
  // DeepSeek-V3: MLA attention and shared experts; layers below first_k_dense_replace are dense.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_shared_experts = 0;
  int64_t first_k_dense_replace = 0;
  // Qwen3-Next: Gated DeltaNet layers (linear attention) between full-attention ones, which are
  // those `layer_types` names "full_attention" or, without it, every full_attention_interval-th
  // (full_attention_layers holds the answer per layer; empty: every layer is full attention); the
  // full-attention q_proj holds an output gate beside each head's query (attn_output_gate); one
  // shared expert per sparse layer.
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  std::vector<bool> full_attention_layers;
  bool attn_output_gate = false;
  int64_t shared_expert_intermediate_size = 0;

  int64_t effective_head_dim() const { return head_dim ? head_dim : hidden_size / num_heads; }
  bool layer_is_moe(int64_t layer) const;
  // Layer `layer` is full attention (else Gated DeltaNet): every layer but Qwen3-Next's linear ones.
  bool layer_is_full_attention(int64_t layer) const;
  // Sizes positive; heads, KV heads and the intermediate size split over `tp_size` ranks.
  Status validate(int tp_size) const;
};

Result<ModelConfig> parse_hf_config(std::string_view json_text);
Result<ModelConfig> load_hf_config(const std::string& path);

Result<ModelDesc> describe_model(const ModelConfig& cfg);

}  // namespace ferry::sharding

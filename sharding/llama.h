// The Llama family's tensor-parallel layout: fused qkv (GQA, KV heads replicated when TP exceeds
// them) and gate_up, column- and row-parallel linears, vocab-parallel embedding and lm_head.
#pragma once

#include <cstdint>
#include <string>

#include "sharding/model_spec.h"

namespace ferry::sharding {

struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // 0: hidden_size / num_heads
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2
  bool qk_norm = false;   // Qwen3
  DType dtype = DType::kBF16;
  int64_t vocab_pad_multiple = 64;  // each rank's vocabulary shard is padded to this multiple

  int64_t effective_head_dim() const { return head_dim ? head_dim : hidden_size / num_heads; }
  Status validate(int tp_size) const;
};

// Every tensor a trainer sends for this model, in checkpoint order.
Manifest llama_manifest(const LlamaConfig& cfg);

// The parameters of TP rank `tp_rank` of `tp_size`; linear layers use `linear_scheme`, embeddings,
// norms and biases stay in full precision (Scheme::kNone).
Result<RankSpec> llama_rank_spec(const LlamaConfig& cfg, int tp_rank, int tp_size, Scheme linear_scheme);

}  // namespace ferry::sharding

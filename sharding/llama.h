// The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) as a preset of the
// generic model description: a dense ModelConfig, laid out by describe_model() and
// model_rank_spec() (fused qkv with KV heads replicated when TP exceeds them, gate_up, column- and
// row-parallel linears, vocab-parallel embedding and lm_head).
#pragma once

#include "core/scheme.h"
#include "core/status.h"
#include "sharding/layout.h"
#include "sharding/model_config.h"

namespace ferry::sharding {

// A dense model (num_experts 0); family may stay empty.
using LlamaConfig = ModelConfig;

// A parsed config.json's dense families as a LlamaConfig; mixtures of experts are refused.
Result<LlamaConfig> to_llama_config(const ModelConfig& cfg);

// Every tensor a trainer sends for this model, in checkpoint order (empty when the config cannot
// be described).
Manifest llama_manifest(const LlamaConfig& cfg);

// The parameters of TP rank `tp_rank` of `tp_size`; linear layers use `linear_scheme`, embeddings,
// norms and biases stay in full precision (Scheme::kNone).
Result<RankSpec> llama_rank_spec(const LlamaConfig& cfg, int tp_rank, int tp_size, Scheme linear_scheme);

}  // namespace ferry::sharding

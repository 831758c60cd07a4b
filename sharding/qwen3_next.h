// The Qwen3-Next layout (Qwen3NextForCausalLM: Qwen3-Next-80B-A3B): hybrid layers, most of them
// Gated DeltaNet linear attention and every `full_attention_interval`-th one gated full attention,
// each followed by routed experts with one shared expert. Engine names and TP splits as vLLM loads
// them (vllm/model_executor/models/qwen3_next.py, its linear-attention layer and FusedMoE):
// - full attention: qkv_proj from q_proj (each head's query rows then its output gate's rows, so
//   split as 2 x num_attention_heads heads), k_proj and v_proj (KV heads replicated past their
//   count); o_proj row-parallel; q_norm, k_norm replicated;
// - linear attention: in_proj_qkvz and in_proj_ba column-parallel in whole key-head groups (each
//   [q, k, v, z] and [b, a]); conv1d.weight [conv_dim, 1, kernel] cut into its q, k and v channel
//   sections, each split over TP (mamba_v2_sharded_weight_loader); A_log and dt_bias split by value
//   head; norm replicated; out_proj row-parallel;
// - experts as FusedMoE's w13_weight / w2_weight, the shared expert's gate_up_proj / down_proj,
//   router and shared_expert_gate replicated.
// The multi-token-prediction tensors (mtp.*) are not the main model's: vLLM and transformers skip them.
#pragma once

#include "core/status.h"
#include "sharding/layout.h"
#include "sharding/model_config.h"

namespace ferry::sharding {

// The Gated DeltaNet sizes positive, value heads a multiple of key heads; the error names the key.
Status check_qwen3_next(const ModelConfig& cfg);

// `cfg.family` is qwen3_next; its sizes are checked first (check_qwen3_next).
Result<ModelDesc> describe_qwen3_next(const ModelConfig& cfg);

}  // namespace ferry::sharding

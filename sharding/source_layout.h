// Where a trainer rank's boxes of the checkpoint tensors lie in its own memory, when its tensors are
// not the checkpoint's: Megatron-Core fuses q, k and v into one `linear_qkv` (per KV-head group: the
// group's query heads, then its key head, then its value head) and gate and up into `linear_fc1`,
// and splits each linear over its TP ranks (column-parallel by rows, row-parallel by columns). A
// source layout lists, per held box of a checkpoint tensor, the local tensor and the first row of
// it where the box's rows lie (the box's other dimensions span the local tensor's). It is the
// sending side's counterpart of the rank-side mapping (mapping.h): the trainer declares the boxes
// as its holdings and packs pieces straight from its fused local tensors.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "sharding/holdings.h"
#include "sharding/model_config.h"

namespace ferry::sharding {

struct LocalBox {
  Holding box;        // the checkpoint tensor and the box of it held
  std::string local;  // the local tensor holding it
  int64_t row = 0;    // the box's first row in the local tensor
  bool operator==(const LocalBox&) const = default;
};

struct SourceLayout {
  std::vector<LocalBox> boxes;
  bool empty() const { return boxes.empty(); }
  bool operator==(const SourceLayout&) const = default;
};

// A Megatron-Core trainer rank's place: its TP rank of the attention and dense layers, and, for
// mixture-of-experts layers, its expert-parallel rank (holding experts [ep_rank, ep_rank + 1) x
// experts / ep) and its expert-tensor-parallel rank (Megatron's expert_tensor_parallel_size).
struct MegatronRank {
  int tp = 1, tp_rank = 0;
  int ep = 1, ep_rank = 0;
  int etp = 1, etp_rank = 0;
};

// Megatron-Core's GPT layout of a Llama-family model (Llama, Mistral, Qwen2, Qwen3, and the
// Qwen3-MoE and Mixtral experts) for one trainer rank
// (pipeline stages simply hold different layers: `layers` [first, last) of them, the embedding on
// the stage holding layer 0, the final norm and output layer on the one holding the last):
//   embedding.word_embeddings.weight                     vocab rows split
//   decoder.layers.L.self_attention.linear_qkv.weight    [groups/tp x (q heads, k, v) x head_dim, H]
//   decoder.layers.L.self_attention.linear_qkv.bias      the same order (qkv biases: Qwen2, attention_bias)
//   decoder.layers.L.self_attention.linear_qkv.layer_norm_weight   (input_layernorm)
//   decoder.layers.L.self_attention.q_layernorm.weight, k_layernorm.weight   [head_dim] (q/k norms: Qwen3)
//   decoder.layers.L.self_attention.linear_proj.weight   [H, heads/tp x head_dim]
//   decoder.layers.L.mlp.linear_fc1.weight               [gate rows/tp; up rows/tp], H]
//   decoder.layers.L.mlp.linear_fc1.layer_norm_weight    (post_attention_layernorm)
//   decoder.layers.L.mlp.linear_fc2.weight               [H, intermediate/tp]
//   decoder.final_layernorm.weight, output_layer.weight  (vocab rows split)
// A mixture-of-experts layer instead of linear_fc1 / linear_fc2 (megatron/core/transformer/moe:
// TEGroupedMLP's sharded_state_dict, local expert i is global expert ep_rank x local + i):
//   decoder.layers.L.pre_mlp_layernorm.weight            (post_attention_layernorm)
//   decoder.layers.L.mlp.router.weight                   [experts, H] (mlp.gate / block_sparse_moe.gate)
//   decoder.layers.L.mlp.experts.linear_fc1.weight{i}    [[gate rows/etp; up rows/etp], H]
//   decoder.layers.L.mlp.experts.linear_fc2.weight{i}    [H, moe_intermediate/etp]
// Shared experts are not laid out (refused).
// Norms are replicated over the TP ranks (copies: the planner sends each from one of them). KV
// heads must split over the TP ranks. The vocabulary is padded as Megatron pads it (to a multiple
// of `vocab_divisible_by` x tp_size, its make-vocab-size-divisible-by, 128 by default) and each rank
// holds padded / tp_size rows; a box covers the real rows among them, the padding lies beyond it.
// `layers` {first, -1}: through the last layer.
Result<SourceLayout> megatron_layout(const ModelConfig& cfg, const MegatronRank& rank,
                                     std::pair<int64_t, int64_t> layers = {0, -1}, int64_t vocab_divisible_by = 128);
// TP rank `tp_rank` of `tp_size`, no expert parallelism, expert TP the TP (Megatron's default).
inline Result<SourceLayout> megatron_layout(const ModelConfig& cfg, int tp_rank, int tp_size,
                                            std::pair<int64_t, int64_t> layers = {0, -1},
                                            int64_t vocab_divisible_by = 128) {
  return megatron_layout(cfg, MegatronRank{tp_size, tp_rank, 1, 0, tp_size, tp_rank}, layers, vocab_divisible_by);
}

// Where trainer rank `rank` (of `ranks`, a multiple of tp x pp) sits in Megatron-Core's default
// order, "tp-cp-ep-dp-pp": pipeline stages outermost; within a stage, the dense grid puts TP
// innermost, and the expert grid expert-TP innermost, then EP. Its stage in `stage`.
Result<MegatronRank> megatron_rank(int rank, int ranks, int tp, int pp, int ep, int etp, int* stage);

// Trainer rank `rank` of `ranks` of a Megatron-Core trainer of TP `tp`, `pp` pipeline stages (the
// layers split evenly over them, refused otherwise), EP `ep` and expert TP `etp` (0: `tp`):
// megatron_rank() places it, megatron_layout() lays out its stage's layers.
Result<SourceLayout> megatron_rank_layout(const ModelConfig& cfg, int rank, int ranks, int tp, int pp = 1, int ep = 1,
                                          int etp = 0);

// The holdings a source layout declares.
SenderInfo layout_holdings(const SourceLayout& layout);

}  // namespace ferry::sharding

// A Megatron-Core trainer's local tensors for the sharded-trainer tests, built from a checkpoint by
// Megatron's own definitions, independently of sharding/source_layout.cc:
//  - attention (megatron/core/transformer/attention.py, SelfAttention.get_query_key_value_tensors):
//    linear_qkv's output rows are, per query group (KV head) of the rank, that group's query heads,
//    then its key head, then its value head; each TP rank holds num_query_groups / tp groups;
//  - linear_proj and linear_fc2 are row-parallel: each rank holds a block of input columns;
//  - linear_fc1 with gated linear units holds [gate; up] of the rank's rows of each (mlp.py);
//  - the vocabulary (embedding and output_layer) is padded first (megatron/training/tokenizer:
//    _vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by (128) x tp) and
//    split by rows (VocabUtility: rank r holds [r, r + 1) x padded / tp), padding rows zero;
//    layer norms are whole on every rank.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "sharding/model_config.h"
#include "tests/coordinator/cluster.h"

namespace ferry::testutil {

struct MegatronShards {
  std::map<std::string, std::vector<uint16_t>> data;
  std::map<std::string, TensorView> views;

  MegatronShards(const sharding::ModelConfig& c, const Checkpoint& ck, int r, int tp) {
    const int64_t h = c.hidden_size, hd = c.effective_head_dim(), groups = c.num_kv_heads;
    const int64_t heads_per_group = c.num_heads / groups, fc = c.intermediate_size / tp;
    auto rows = [&](const std::string& name, int64_t first, int64_t n, int64_t cols, std::vector<uint16_t>& out) {
      const auto& src = ck.data.at(name);
      out.insert(out.end(), src.begin() + first * cols, src.begin() + (first + n) * cols);
    };
    auto columns = [&](const std::string& name, int64_t nrows, int64_t ncols, int64_t first, int64_t n) {
      std::vector<uint16_t> out;
      const auto& src = ck.data.at(name);
      for (int64_t i = 0; i < nrows; ++i) {
        out.insert(out.end(), src.begin() + i * ncols + first, src.begin() + i * ncols + first + n);
      }
      return out;
    };
    auto put = [&](const std::string& local, std::vector<uint16_t> v, Shape shape) {
      auto& d = data[local];
      d = std::move(v);
      views.emplace(local, TensorView(d.data(), DType::kBF16, std::move(shape)));
    };
    int64_t padded = c.vocab_size;
    while (padded % (128 * tp) != 0) ++padded;
    auto vocab_rows = [&](const std::string& name, const std::string& local) {
      const int64_t per = padded / tp;
      const int64_t first = std::min(c.vocab_size, per * r), last = std::min(c.vocab_size, per * (r + 1));
      std::vector<uint16_t> v;
      rows(name, first, last - first, h, v);
      v.resize(static_cast<size_t>(per * h), 0);  // Megatron's padding rows
      put(local, std::move(v), {per, h});
    };
    vocab_rows("model.embed_tokens.weight", "embedding.word_embeddings.weight");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string in = fmt::format("model.layers.{}.", l), out = fmt::format("decoder.layers.{}.", l);
      std::vector<uint16_t> qkv;
      for (int64_t g = r * groups / tp; g < (r + 1) * groups / tp; ++g) {
        rows(in + "self_attn.q_proj.weight", g * heads_per_group * hd, heads_per_group * hd, h, qkv);
        rows(in + "self_attn.k_proj.weight", g * hd, hd, h, qkv);
        rows(in + "self_attn.v_proj.weight", g * hd, hd, h, qkv);
      }
      const int64_t qkv_rows = static_cast<int64_t>(qkv.size()) / h;
      put(out + "self_attention.linear_qkv.weight", std::move(qkv), {qkv_rows, h});
      const int64_t cols = c.num_heads * hd / tp;
      put(out + "self_attention.linear_proj.weight", columns(in + "self_attn.o_proj.weight", h, c.num_heads * hd, r * cols, cols),
          {h, cols});
      std::vector<uint16_t> fc1;
      rows(in + "mlp.gate_proj.weight", r * fc, fc, h, fc1);
      rows(in + "mlp.up_proj.weight", r * fc, fc, h, fc1);
      put(out + "mlp.linear_fc1.weight", std::move(fc1), {2 * fc, h});
      put(out + "mlp.linear_fc2.weight", columns(in + "mlp.down_proj.weight", h, c.intermediate_size, r * fc, fc), {h, fc});
      put(out + "self_attention.linear_qkv.layer_norm_weight", ck.data.at(in + "input_layernorm.weight"), {h});
      put(out + "mlp.linear_fc1.layer_norm_weight", ck.data.at(in + "post_attention_layernorm.weight"), {h});
    }
    put("decoder.final_layernorm.weight", ck.data.at("model.norm.weight"), {h});
    if (!c.tie_word_embeddings) vocab_rows("lm_head.weight", "output_layer.weight");
  }
};

}  // namespace ferry::testutil

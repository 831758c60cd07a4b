// A Megatron-Core trainer rank's local tensors for the sharded-trainer tests, built from a checkpoint by
// Megatron's own definitions, independently of sharding/source_layout.cc:
//  - attention (megatron/core/transformer/attention.py, SelfAttention.get_query_key_value_tensors):
//    linear_qkv's output rows are, per query group (KV head) of the rank, that group's query heads,
//    then its key head, then its value head; each TP rank holds num_query_groups / tp groups;
//  - linear_proj and linear_fc2 are row-parallel: each rank holds a block of input columns;
//  - linear_fc1 with gated linear units holds [gate; up] of the rank's rows of each (mlp.py);
//  - experts (megatron/core/transformer/moe/experts.py, TEGroupedMLP.sharded_state_dict): EP rank p
//    holds global experts [p x local, (p + 1) x local) as local 0..local-1, each linear_fc1.weight{i}
//    [gate; up] of the expert-TP rank's rows and linear_fc2.weight{i} its block of columns; the
//    router (mlp.router.weight) and pre_mlp_layernorm whole;
//  - the vocabulary (embedding and output_layer) is padded first (megatron/training/tokenizer:
//    _vocab_size_with_padding: up to a multiple of make_vocab_size_divisible_by (128) x tp) and
//    split by rows (VocabUtility: rank r holds [r, r + 1) x padded / tp), padding rows zero;
//    layer norms are whole on every rank.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/tensor.h"
#include "sharding/model_config.h"
#include "sharding/source_layout.h"

namespace ferry::testutil {

struct MegatronShards {
  std::map<std::string, std::vector<uint16_t>> data;
  std::map<std::string, TensorView> views;

  // `source(name)`: the checkpoint tensor's bf16 elements, row-major.
  using Source = std::function<std::span<const uint16_t>(const std::string&)>;

  MegatronShards(const sharding::ModelConfig& c, const Source& source, const sharding::MegatronRank& m) {
    const int r = m.tp_rank, tp = m.tp;
    const int64_t h = c.hidden_size, hd = c.effective_head_dim(), groups = c.num_kv_heads;
    const int64_t heads_per_group = c.num_heads / groups, fc = c.intermediate_size / tp;
    auto rows = [&](const std::string& name, int64_t first, int64_t n, int64_t cols, std::vector<uint16_t>& out) {
      const auto src = source(name);
      out.insert(out.end(), src.begin() + first * cols, src.begin() + (first + n) * cols);
    };
    auto columns = [&](const std::string& name, int64_t nrows, int64_t ncols, int64_t first, int64_t n) {
      std::vector<uint16_t> out;
      const auto src = source(name);
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
    auto whole = [&](const std::string& local, const std::string& name, Shape shape) {
      const auto src = source(name);
      put(local, std::vector<uint16_t>(src.begin(), src.end()), std::move(shape));
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
      if (c.qk_norm) {
        whole(out + "self_attention.q_layernorm.weight", in + "self_attn.q_norm.weight", {hd});
        whole(out + "self_attention.k_layernorm.weight", in + "self_attn.k_norm.weight", {hd});
      }
      const int64_t cols = c.num_heads * hd / tp;
      put(out + "self_attention.linear_proj.weight",
          columns(in + "self_attn.o_proj.weight", h, c.num_heads * hd, r * cols, cols), {h, cols});
      whole(out + "self_attention.linear_qkv.layer_norm_weight", in + "input_layernorm.weight", {h});
      if (c.layer_is_moe(l)) {
        whole(out + "pre_mlp_layernorm.weight", in + "post_attention_layernorm.weight", {h});
        whole(out + "mlp.router.weight", in + "mlp.gate.weight", {c.num_experts, h});
        const int64_t local = c.num_experts / m.ep, mi = c.moe_intermediate_size / m.etp;
        for (int64_t i = 0; i < local; ++i) {
          const std::string ex = fmt::format("{}mlp.experts.{}.", in, m.ep_rank * local + i);
          std::vector<uint16_t> fc1;
          rows(ex + "gate_proj.weight", m.etp_rank * mi, mi, h, fc1);
          rows(ex + "up_proj.weight", m.etp_rank * mi, mi, h, fc1);
          put(fmt::format("{}mlp.experts.linear_fc1.weight{}", out, i), std::move(fc1), {2 * mi, h});
          put(fmt::format("{}mlp.experts.linear_fc2.weight{}", out, i),
              columns(ex + "down_proj.weight", h, c.moe_intermediate_size, m.etp_rank * mi, mi), {h, mi});
        }
        continue;
      }
      std::vector<uint16_t> fc1;
      rows(in + "mlp.gate_proj.weight", r * fc, fc, h, fc1);
      rows(in + "mlp.up_proj.weight", r * fc, fc, h, fc1);
      put(out + "mlp.linear_fc1.weight", std::move(fc1), {2 * fc, h});
      put(out + "mlp.linear_fc2.weight", columns(in + "mlp.down_proj.weight", h, c.intermediate_size, r * fc, fc),
          {h, fc});
      whole(out + "mlp.linear_fc1.layer_norm_weight", in + "post_attention_layernorm.weight", {h});
    }
    whole("decoder.final_layernorm.weight", "model.norm.weight", {h});
    if (!c.tie_word_embeddings) vocab_rows("lm_head.weight", "output_layer.weight");
  }
};

}  // namespace ferry::testutil

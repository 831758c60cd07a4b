#include "sharding/source_layout.h"

#include <string_view>

#include <fmt/format.h>

#include "sharding/planner.h"

namespace ferry::sharding {
namespace {

// Rows [row0, row0 + rows) x every column of a [.., cols] checkpoint tensor.
Holding rows_box(const std::string& name, int64_t row0, int64_t rows, int64_t cols) {
  return {name, Region{{row0, 0}, {rows, cols}}};
}

std::string layer_name(int64_t l, const char* rest) { return fmt::format("model.layers.{}.{}", l, rest); }
std::string mcore(int64_t l, const char* rest) { return fmt::format("decoder.layers.{}.{}", l, rest); }

}  // namespace

Result<SourceLayout> megatron_layout(const ModelConfig& cfg, int tp_rank, int tp_size,
                                     std::pair<int64_t, int64_t> layers, int64_t vocab_divisible_by) {
  if (cfg.num_experts > 0) return Status::invalid_argument("megatron_layout does not lay out mixture-of-experts layers");
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return Status::invalid_argument(fmt::format("megatron_layout: TP rank {} of {}", tp_rank, tp_size));
  }
  const int64_t h = cfg.hidden_size, hd = cfg.effective_head_dim(), kv = cfg.num_kv_heads;
  const int64_t inter = cfg.intermediate_size, vocab = cfg.vocab_size;
  if (kv % tp_size || cfg.num_heads % kv || inter % tp_size) {
    return Status::invalid_argument(fmt::format(
        "megatron_layout: {} KV heads, {} heads and an intermediate size of {} do not split over {} TP ranks", kv,
        cfg.num_heads, inter, tp_size));
  }
  const int64_t first = layers.first, last = layers.second < 0 ? cfg.num_layers : layers.second;
  const int64_t per_group = cfg.num_heads / kv, groups = kv / tp_size, fc = inter / tp_size;
  const int64_t multiple = std::max<int64_t>(vocab_divisible_by, 1) * tp_size;
  const int64_t vrows = (vocab + multiple - 1) / multiple * multiple / tp_size;  // per rank, padded
  const int64_t v0 = std::min(vocab, vrows * tp_rank), v1 = std::min(vocab, vrows * (tp_rank + 1));
  SourceLayout out;
  auto put = [&](Holding box, std::string local, int64_t row) { out.boxes.push_back({std::move(box), std::move(local), row}); };
  auto whole = [&](const std::string& name, int64_t n, std::string local) {
    put({name, Region{{0}, {n}}}, std::move(local), 0);
  };
  if (first == 0) put(rows_box("model.embed_tokens.weight", v0, v1 - v0, h), "embedding.word_embeddings.weight", 0);
  for (int64_t l = first; l < last; ++l) {
    // linear_qkv's rows (and its bias's elements), per query group of the rank: the group's query
    // heads, its key head, its value head.
    for (const char* kind : {"weight", "bias"}) {
      const bool bias = std::string_view(kind) == "bias";
      if (bias && !cfg.qkv_bias) continue;
      const std::string qkv = mcore(l, fmt::format("self_attention.linear_qkv.{}", kind).c_str());
      auto box = [&](const char* proj, int64_t row0, int64_t rows) {
        const std::string name = layer_name(l, fmt::format("self_attn.{}.{}", proj, kind).c_str());
        return bias ? Holding{name, Region{{row0}, {rows}}} : rows_box(name, row0, rows, h);
      };
      int64_t at = 0;
      for (int64_t g = tp_rank * groups; g < (tp_rank + 1) * groups; ++g) {
        put(box("q_proj", g * per_group * hd, per_group * hd), qkv, at);
        at += per_group * hd;
        put(box("k_proj", g * hd, hd), qkv, at);
        at += hd;
        put(box("v_proj", g * hd, hd), qkv, at);
        at += hd;
      }
    }
    if (cfg.qk_norm) {  // per head, the same on every rank (Megatron's q_layernorm / k_layernorm)
      whole(layer_name(l, "self_attn.q_norm.weight"), hd, mcore(l, "self_attention.q_layernorm.weight"));
      whole(layer_name(l, "self_attn.k_norm.weight"), hd, mcore(l, "self_attention.k_layernorm.weight"));
    }
    const int64_t cols = cfg.num_heads * hd / tp_size;
    put({layer_name(l, "self_attn.o_proj.weight"), Region{{0, tp_rank * cols}, {h, cols}}},
        mcore(l, "self_attention.linear_proj.weight"), 0);
    const std::string fc1 = mcore(l, "mlp.linear_fc1.weight");
    put(rows_box(layer_name(l, "mlp.gate_proj.weight"), tp_rank * fc, fc, h), fc1, 0);
    put(rows_box(layer_name(l, "mlp.up_proj.weight"), tp_rank * fc, fc, h), fc1, fc);
    put({layer_name(l, "mlp.down_proj.weight"), Region{{0, tp_rank * fc}, {h, fc}}}, mcore(l, "mlp.linear_fc2.weight"), 0);
    whole(layer_name(l, "input_layernorm.weight"), h, mcore(l, "self_attention.linear_qkv.layer_norm_weight"));
    whole(layer_name(l, "post_attention_layernorm.weight"), h, mcore(l, "mlp.linear_fc1.layer_norm_weight"));
  }
  if (last == cfg.num_layers) {
    whole("model.norm.weight", h, "decoder.final_layernorm.weight");
    if (!cfg.tie_word_embeddings) put(rows_box("lm_head.weight", v0, v1 - v0, h), "output_layer.weight", 0);
  }
  return out;
}

SenderInfo layout_holdings(const SourceLayout& layout) {
  SenderInfo out;
  for (const auto& b : layout.boxes) out.holds.push_back(b.box);
  return out;
}

}  // namespace ferry::sharding

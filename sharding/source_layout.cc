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

Result<MegatronRank> megatron_rank(int rank, int ranks, int tp, int pp, int ep, int etp, int* stage) {
  if (tp < 1 || pp < 1 || ep < 1 || etp < 1 || ranks % (tp * pp) != 0 || (ranks / pp) % (ep * etp) != 0) {
    return Status::invalid_argument(fmt::format(
        "{} Megatron ranks do not split into {} pipeline stages of TP {} x data-parallel groups and of EP {} x "
        "expert TP {} groups",
        ranks, pp, tp, ep, etp));
  }
  if (rank < 0 || rank >= ranks) return Status::invalid_argument(fmt::format("Megatron rank {} of {}", rank, ranks));
  const int per_stage = ranks / pp, in_stage = rank % per_stage;
  if (stage != nullptr) *stage = rank / per_stage;
  return MegatronRank{tp, in_stage % tp, ep, (in_stage / etp) % ep, etp, in_stage % etp};
}

Result<SourceLayout> megatron_layout(const ModelConfig& cfg, const MegatronRank& rank,
                                     std::pair<int64_t, int64_t> layers, int64_t vocab_divisible_by) {
  const int tp_rank = rank.tp_rank, tp_size = rank.tp;
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return Status::invalid_argument(fmt::format("megatron_layout: TP rank {} of {}", tp_rank, tp_size));
  }
  const bool moe = cfg.num_experts > 0;
  if (moe && (cfg.n_shared_experts > 0 || cfg.shared_expert_intermediate_size > 0 || cfg.family == "deepseek_v3" ||
              cfg.family == "qwen3_next")) {
    return Status::invalid_argument(
        fmt::format("megatron_layout: {} has shared experts or MLA attention, which it does not lay out", cfg.family));
  }
  if (rank.ep < 1 || rank.ep_rank < 0 || rank.ep_rank >= rank.ep || rank.etp < 1 || rank.etp_rank < 0 ||
      rank.etp_rank >= rank.etp) {
    return Status::invalid_argument(fmt::format("megatron_layout: EP rank {} of {}, expert TP rank {} of {}",
                                                rank.ep_rank, rank.ep, rank.etp_rank, rank.etp));
  }
  if (moe && (cfg.num_experts % rank.ep || cfg.moe_intermediate_size % rank.etp)) {
    return Status::invalid_argument(
        fmt::format("megatron_layout: {} experts of intermediate size {} do not split over EP {} and expert TP {}",
                    cfg.num_experts, cfg.moe_intermediate_size, rank.ep, rank.etp));
  }
  const int64_t h = cfg.hidden_size, hd = cfg.effective_head_dim(), kv = cfg.num_kv_heads;
  const int64_t inter = cfg.intermediate_size, vocab = cfg.vocab_size;
  bool any_dense = false;
  for (int64_t l = 0; l < cfg.num_layers && !any_dense; ++l) any_dense = !cfg.layer_is_moe(l);
  if (kv % tp_size || cfg.num_heads % kv || (any_dense && inter % tp_size)) {
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
    whole(layer_name(l, "input_layernorm.weight"), h, mcore(l, "self_attention.linear_qkv.layer_norm_weight"));
    if (cfg.layer_is_moe(l)) {
      // The router and the rank's experts; Mixtral names them block_sparse_moe, w1 / w3 / w2.
      const bool mixtral = cfg.family == "mixtral";
      const std::string block = mixtral ? "block_sparse_moe" : "mlp";
      whole(layer_name(l, "post_attention_layernorm.weight"), h, mcore(l, "pre_mlp_layernorm.weight"));
      put(rows_box(layer_name(l, (block + ".gate.weight").c_str()), 0, cfg.num_experts, h),
          mcore(l, "mlp.router.weight"), 0);
      const int64_t local = cfg.num_experts / rank.ep, mi = cfg.moe_intermediate_size / rank.etp;
      for (int64_t i = 0; i < local; ++i) {
        const int64_t e = rank.ep_rank * local + i;
        auto expert = [&](const char* proj) {
          return layer_name(l, fmt::format("{}.experts.{}.{}.weight", block, e, proj).c_str());
        };
        const std::string fc1 = mcore(l, fmt::format("mlp.experts.linear_fc1.weight{}", i).c_str());
        put(rows_box(expert(mixtral ? "w1" : "gate_proj"), rank.etp_rank * mi, mi, h), fc1, 0);
        put(rows_box(expert(mixtral ? "w3" : "up_proj"), rank.etp_rank * mi, mi, h), fc1, mi);
        put({expert(mixtral ? "w2" : "down_proj"), Region{{0, rank.etp_rank * mi}, {h, mi}}},
            mcore(l, fmt::format("mlp.experts.linear_fc2.weight{}", i).c_str()), 0);
      }
      continue;
    }
    const std::string fc1 = mcore(l, "mlp.linear_fc1.weight");
    put(rows_box(layer_name(l, "mlp.gate_proj.weight"), tp_rank * fc, fc, h), fc1, 0);
    put(rows_box(layer_name(l, "mlp.up_proj.weight"), tp_rank * fc, fc, h), fc1, fc);
    put({layer_name(l, "mlp.down_proj.weight"), Region{{0, tp_rank * fc}, {h, fc}}}, mcore(l, "mlp.linear_fc2.weight"),
        0);
    whole(layer_name(l, "post_attention_layernorm.weight"), h, mcore(l, "mlp.linear_fc1.layer_norm_weight"));
  }
  if (last == cfg.num_layers) {
    whole("model.norm.weight", h, "decoder.final_layernorm.weight");
    if (!cfg.tie_word_embeddings) put(rows_box("lm_head.weight", v0, v1 - v0, h), "output_layer.weight", 0);
  }
  return out;
}

Result<SourceLayout> megatron_rank_layout(const ModelConfig& cfg, int rank, int ranks, int tp, int pp, int ep,
                                          int etp) {
  if (ep > 1 && cfg.num_experts == 0) {
    return Status::invalid_argument(fmt::format("Megatron EP {}: {} has no routed experts", ep, cfg.family));
  }
  int stage = 0;
  FERRY_ASSIGN_OR_RETURN(const MegatronRank place, megatron_rank(rank, ranks, tp, pp, ep, etp > 0 ? etp : tp, &stage));
  if (cfg.num_layers % pp != 0) {  // Megatron's default pipeline: the same layers a stage
    return Status::invalid_argument(fmt::format("{} layers do not split into {} pipeline stages", cfg.num_layers, pp));
  }
  const int64_t first = cfg.num_layers * stage / pp, last = cfg.num_layers * (stage + 1) / pp;
  return megatron_layout(cfg, place, {first, last});
}

SenderInfo layout_holdings(const SourceLayout& layout) {
  SenderInfo out;
  for (const auto& b : layout.boxes) out.holds.push_back(b.box);
  return out;
}

}  // namespace ferry::sharding

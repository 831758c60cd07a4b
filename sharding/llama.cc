#include "sharding/llama.h"

#include <fmt/format.h>

namespace ferry::sharding {
namespace {

std::string lname(int64_t i, const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); }

Region rows_of(const Shape& shape, int64_t row0, int64_t rows) {
  Region r = Region::whole(shape);
  r.offset[0] = row0;
  r.size[0] = rows;
  return r;
}

Region cols_of(const Shape& shape, int64_t col0, int64_t cols) {
  Region r = Region::whole(shape);
  r.offset[1] = col0;
  r.size[1] = cols;
  return r;
}

ParamSpec replicated(const std::string& name, const Shape& shape, DType dt) {
  return ParamSpec{name, layer_of(name), shape, dt, Scheme::kNone, {}, {{name, Region::whole(shape), Shape(shape.size(), 0)}}};
}

struct Builder {
  const LlamaConfig& c;
  int r;
  int tp;
  Scheme scheme;
  RankSpec spec;

  int64_t hd() const { return c.effective_head_dim(); }
  int64_t q_heads_local() const { return c.num_heads / tp; }
  // KV heads held by this rank and the first one; replicated when tp > kv heads.
  int64_t kv_heads_local() const { return c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1; }
  int64_t kv_head0() const {
    return c.num_kv_heads >= tp ? r * kv_heads_local() : r / (tp / c.num_kv_heads);
  }

  // qkv weight or bias: rows q | k | v of this rank.
  void add_qkv(int64_t i, const char* kind) {
    const bool bias = std::string_view(kind) == "bias";
    const int64_t h = c.hidden_size;
    const int64_t qr = q_heads_local() * hd(), kr = kv_heads_local() * hd();
    Shape qs = bias ? Shape{c.num_heads * hd()} : Shape{c.num_heads * hd(), h};
    Shape ks = bias ? Shape{c.num_kv_heads * hd()} : Shape{c.num_kv_heads * hd(), h};
    Shape dst = bias ? Shape{qr + 2 * kr} : Shape{qr + 2 * kr, h};
    auto at = [&](int64_t row) { return bias ? Shape{row} : Shape{row, 0}; };
    ParamSpec p{lname(i, bias ? "self_attn.qkv_proj.bias" : "self_attn.qkv_proj.weight"),
                fmt::format("model.layers.{}", i), dst, c.dtype, bias ? Scheme::kNone : scheme,
                {qr, kr, kr}, {}};
    p.slices.push_back({lname(i, bias ? "self_attn.q_proj.bias" : "self_attn.q_proj.weight"),
                        rows_of(qs, r * qr, qr), at(0)});
    p.slices.push_back({lname(i, bias ? "self_attn.k_proj.bias" : "self_attn.k_proj.weight"),
                        rows_of(ks, kv_head0() * hd(), kr), at(qr)});
    p.slices.push_back({lname(i, bias ? "self_attn.v_proj.bias" : "self_attn.v_proj.weight"),
                        rows_of(ks, kv_head0() * hd(), kr), at(qr + kr)});
    spec.params.push_back(std::move(p));
  }

  void add_row_parallel(const std::string& src, const std::string& dst, const Shape& full) {
    const int64_t cols = full[1] / tp;
    spec.params.push_back({dst, layer_of(dst), {full[0], cols}, c.dtype, scheme, {}, {{src, cols_of(full, r * cols, cols), {0, 0}}}});
  }

  void add_vocab_parallel(const std::string& src, const std::string& dst) {
    const int64_t per_raw = (c.vocab_size + tp - 1) / tp;
    const int64_t per = (per_raw + c.vocab_pad_multiple - 1) / c.vocab_pad_multiple * c.vocab_pad_multiple;
    const Shape full{c.vocab_size, c.hidden_size};
    const int64_t row0 = std::min<int64_t>(c.vocab_size, r * per);
    const int64_t rows = std::min<int64_t>(c.vocab_size, row0 + per) - row0;
    ParamSpec p{dst, layer_of(dst), {per, c.hidden_size}, c.dtype, Scheme::kNone, {}, {}};
    if (rows > 0) p.slices.push_back({src, rows_of(full, row0, rows), {0, 0}});
    spec.params.push_back(std::move(p));
  }

  void build() {
    const int64_t h = c.hidden_size, inter = c.intermediate_size;
    add_vocab_parallel("model.embed_tokens.weight", "model.embed_tokens.weight");
    for (int64_t i = 0; i < c.num_layers; ++i) {
      spec.params.push_back(replicated(lname(i, "input_layernorm.weight"), {h}, c.dtype));
      add_qkv(i, "weight");
      if (c.qkv_bias) add_qkv(i, "bias");
      if (c.qk_norm) {
        spec.params.push_back(replicated(lname(i, "self_attn.q_norm.weight"), {hd()}, c.dtype));
        spec.params.push_back(replicated(lname(i, "self_attn.k_norm.weight"), {hd()}, c.dtype));
      }
      add_row_parallel(lname(i, "self_attn.o_proj.weight"), lname(i, "self_attn.o_proj.weight"),
                       {h, c.num_heads * hd()});
      spec.params.push_back(replicated(lname(i, "post_attention_layernorm.weight"), {h}, c.dtype));
      const int64_t ir = inter / tp;
      const Shape full{inter, h};
      ParamSpec gu{lname(i, "mlp.gate_up_proj.weight"), fmt::format("model.layers.{}", i),
                   {2 * ir, h}, c.dtype, scheme, {ir, ir}, {}};
      gu.slices.push_back({lname(i, "mlp.gate_proj.weight"), rows_of(full, r * ir, ir), {0, 0}});
      gu.slices.push_back({lname(i, "mlp.up_proj.weight"), rows_of(full, r * ir, ir), {ir, 0}});
      spec.params.push_back(std::move(gu));
      add_row_parallel(lname(i, "mlp.down_proj.weight"), lname(i, "mlp.down_proj.weight"), {h, inter});
    }
    spec.params.push_back(replicated("model.norm.weight", {h}, c.dtype));
    add_vocab_parallel(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", "lm_head.weight");
  }
};

}  // namespace

Status LlamaConfig::validate(int tp_size) const {
  if (hidden_size <= 0 || num_heads <= 0 || num_kv_heads <= 0 || intermediate_size <= 0 || vocab_size <= 0 ||
      num_layers < 0) {
    return Status::invalid_argument("llama config: sizes must be positive");
  }
  if (tp_size <= 0) return Status::invalid_argument("tp size must be positive");
  if (num_heads % num_kv_heads) return Status::invalid_argument("llama config: heads not a multiple of kv heads");
  if (num_heads % tp_size) {
    return Status::invalid_argument(fmt::format("{} attention heads do not split over TP {}", num_heads, tp_size));
  }
  if (num_kv_heads >= tp_size ? num_kv_heads % tp_size : tp_size % num_kv_heads) {
    return Status::invalid_argument(fmt::format("{} KV heads do not split over TP {}", num_kv_heads, tp_size));
  }
  if (intermediate_size % tp_size) {
    return Status::invalid_argument(fmt::format("intermediate size {} does not split over TP {}", intermediate_size, tp_size));
  }
  if (vocab_pad_multiple <= 0) return Status::invalid_argument("vocab_pad_multiple must be positive");
  return ok_status();
}

Manifest llama_manifest(const LlamaConfig& c) {
  const int64_t h = c.hidden_size, hd = c.effective_head_dim(), inter = c.intermediate_size;
  Manifest m;
  auto add = [&](std::string name, Shape s) { m.push_back({std::move(name), c.dtype, std::move(s)}); };
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    add(lname(i, "input_layernorm.weight"), {h});
    add(lname(i, "self_attn.q_proj.weight"), {c.num_heads * hd, h});
    add(lname(i, "self_attn.k_proj.weight"), {c.num_kv_heads * hd, h});
    add(lname(i, "self_attn.v_proj.weight"), {c.num_kv_heads * hd, h});
    if (c.qkv_bias) {
      add(lname(i, "self_attn.q_proj.bias"), {c.num_heads * hd});
      add(lname(i, "self_attn.k_proj.bias"), {c.num_kv_heads * hd});
      add(lname(i, "self_attn.v_proj.bias"), {c.num_kv_heads * hd});
    }
    if (c.qk_norm) {
      add(lname(i, "self_attn.q_norm.weight"), {hd});
      add(lname(i, "self_attn.k_norm.weight"), {hd});
    }
    add(lname(i, "self_attn.o_proj.weight"), {h, c.num_heads * hd});
    add(lname(i, "post_attention_layernorm.weight"), {h});
    add(lname(i, "mlp.gate_proj.weight"), {inter, h});
    add(lname(i, "mlp.up_proj.weight"), {inter, h});
    add(lname(i, "mlp.down_proj.weight"), {h, inter});
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
  return m;
}

Result<RankSpec> llama_rank_spec(const LlamaConfig& cfg, int tp_rank, int tp_size, Scheme linear_scheme) {
  FERRY_RETURN_IF_ERROR(cfg.validate(tp_size));
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return Status::invalid_argument(fmt::format("tp rank {} outside TP size {}", tp_rank, tp_size));
  }
  Builder b{cfg, tp_rank, tp_size, linear_scheme, {}};
  b.spec.tp_rank = tp_rank;
  b.spec.tp_size = tp_size;
  b.spec.expects = llama_manifest(cfg);
  b.build();
  return std::move(b.spec);
}

}  // namespace ferry::sharding

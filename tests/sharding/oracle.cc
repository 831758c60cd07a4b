#include "tests/sharding/oracle.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::sharding::testing {
namespace {

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

// vLLM's VocabParallelEmbedding: divide(pad_vocab_size(vocab, pad), tp).
int64_t vocab_per_rank(const TCfg& c) { return (c.vocab + c.pad - 1) / c.pad * c.pad / c.tp; }

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace

std::string TCfg::describe() const {
  return fmt::format("h={} nh={} kv={} hd={} inter={} vocab={} layers={} tie={} bias={} qk_norm={} experts={} mi={} "
                     "step={} mixtral={} stacked={} tp={} ep={} pad={} replicas={}",
                     h, nh, kv, hd, inter, vocab, layers, tie, bias, qk_norm, experts, mi, sparse_step, mixtral, stacked,
                     tp, ep, pad, replicas);
}

ModelConfig TCfg::model_config() const {
  ModelConfig m;
  m.family = mixtral ? "mixtral" : experts > 0 ? "qwen3_moe" : "llama";
  m.hidden_size = h;
  m.num_heads = nh;
  m.num_kv_heads = kv;
  m.head_dim = hd;
  m.intermediate_size = inter;
  m.vocab_size = vocab;
  m.num_layers = layers;
  m.tie_word_embeddings = tie;
  m.qkv_bias = bias;
  m.qk_norm = qk_norm;
  m.vocab_pad_multiple = pad;
  m.num_experts = experts;
  m.moe_intermediate_size = mi;
  m.decoder_sparse_step = sparse_step;
  return m;
}

TCfg random_cfg(std::mt19937_64& rng, bool moe) {
  TCfg c;
  c.tp = static_cast<int>(pick(rng, 1, 8));
  std::vector<int64_t> below;
  for (int64_t d = 1; d < c.tp; ++d) {
    if (c.tp % d == 0) below.push_back(d);
  }
  if (!below.empty() && pick(rng, 0, 1)) {
    c.kv = below[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(below.size()) - 1))];
  } else {
    c.kv = c.tp * pick(rng, 1, 2);
  }
  c.nh = std::max<int64_t>(c.kv, c.tp) * pick(rng, 1, 2);
  const int64_t hds[] = {2, 4, 8};
  c.hd = hds[pick(rng, 0, 2)];
  c.h = pick(rng, 3, 20);
  c.inter = c.tp * pick(rng, 1, 3);
  c.vocab = pick(rng, std::max(1, c.tp - 2), 12 * c.tp + 7);
  const int64_t pads[] = {1, 3, 8};  // times TP: the padded vocabulary splits evenly, as engines require
  c.pad = pads[pick(rng, 0, 2)] * c.tp;
  c.layers = pick(rng, 1, 3);
  c.tie = pick(rng, 0, 1);
  c.bias = pick(rng, 0, 1);
  c.qk_norm = pick(rng, 0, 1);
  c.replicas = static_cast<int>(pick(rng, 1, 2));
  if (moe) {
    std::vector<int> eps;
    for (int d = 1; d <= c.tp; ++d) {
      if (c.tp % d == 0) eps.push_back(d);
    }
    c.ep = eps[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(eps.size()) - 1))];
    c.experts = c.ep * pick(rng, 1, 3);
    c.mi = (c.tp / c.ep) * pick(rng, 1, 2);
    c.sparse_step = pick(rng, 1, 2);
    c.mixtral = pick(rng, 0, 1);
  }
  return c;
}

void expected_places(const TCfg& c, const std::string& name, const Shape& shape, int64_t flat, std::vector<Place>* out) {
  // Experts held stacked (transformers' Qwen3MoeExperts / MixtralExperts): gate_up_proj [E, 2I, H]
  // is expert e's gate rows then its up rows, down_proj [E, H, I] its down matrix; each element is
  // the element of that expert's own tensor.
  if (shape.size() == 3 && (name.ends_with(".experts.gate_up_proj") || name.ends_with(".experts.down_proj"))) {
    const int64_t rows = shape[1], cols = shape[2];
    const int64_t e = flat / (rows * cols), r = flat / cols % rows, j = flat % cols;
    const std::string prefix = name.substr(0, name.rfind('.') + 1) + std::to_string(e) + ".";
    std::string part;
    int64_t row = r;
    if (name.ends_with("down_proj")) {
      part = c.mixtral ? "w2.weight" : "down_proj.weight";
    } else {
      part = r < c.mi ? (c.mixtral ? "w1.weight" : "gate_proj.weight") : (c.mixtral ? "w3.weight" : "up_proj.weight");
      row = r % c.mi;
    }
    const int64_t per_rows = name.ends_with("down_proj") ? rows : c.mi;
    return expected_places(c, prefix + part, {per_rows, cols}, row * cols + j, out);
  }
  const int64_t cols = shape.size() == 2 ? shape[1] : 1;
  const int64_t i = flat / cols, j = flat % cols;
  std::vector<std::pair<int, std::pair<std::string, int64_t>>> per_rank;  // (tp rank, (param, flat))
  auto all_ranks = [&](const std::string& param) {
    for (int r = 0; r < c.tp; ++r) per_rank.push_back({r, {param, flat}});
  };
  auto vocab = [&](const std::string& param) {
    const int64_t per = vocab_per_rank(c);
    per_rank.push_back({static_cast<int>(i / per), {param, (i % per) * cols + j}});
  };
  std::string prefix, rest = name;
  if (name.starts_with("model.layers.")) {
    const size_t dot = name.find('.', 13);
    prefix = name.substr(0, dot + 1);
    rest = name.substr(dot + 1);
  }
  const int64_t qr = c.nh * c.hd / c.tp;
  if (name == "model.embed_tokens.weight") {
    vocab("model.embed_tokens.weight");
    if (c.tie) vocab("lm_head.weight");
  } else if (name == "lm_head.weight") {
    vocab("lm_head.weight");
  } else if (name == "model.norm.weight" || rest == "input_layernorm.weight" || rest == "post_attention_layernorm.weight" ||
             rest == "self_attn.q_norm.weight" || rest == "self_attn.k_norm.weight" || rest == "mlp.gate.weight" ||
             rest == "block_sparse_moe.gate.weight") {
    all_ranks(name);
  } else if (rest.starts_with("self_attn.q_proj.") || rest.starts_with("self_attn.k_proj.") ||
             rest.starts_with("self_attn.v_proj.")) {
    const std::string kind = rest.substr(rest.rfind('.') + 1);
    const std::string param = prefix + "self_attn.qkv_proj." + kind;
    const char which = rest[10];  // q, k or v
    if (which == 'q') {
      per_rank.push_back({static_cast<int>(i / qr), {param, (i % qr) * cols + j}});
    } else if (c.kv >= c.tp) {
      const int64_t kr = c.kv * c.hd / c.tp;
      const int64_t row = qr + (which == 'v' ? kr : 0) + i % kr;
      per_rank.push_back({static_cast<int>(i / kr), {param, row * cols + j}});
    } else {
      // Fewer KV heads than ranks: head i / hd lives on every rank r with r / (tp / kv) == head.
      const int64_t head = i / c.hd;
      const int64_t row = qr + (which == 'v' ? c.hd : 0) + i % c.hd;
      for (int r = 0; r < c.tp; ++r) {
        if (r / (c.tp / c.kv) == head) per_rank.push_back({r, {param, row * cols + j}});
      }
    }
  } else if (rest == "self_attn.o_proj.weight" || rest == "mlp.down_proj.weight") {
    const int64_t local = cols / c.tp;
    per_rank.push_back({static_cast<int>(j / local), {name, i * local + j % local}});
  } else if (rest == "mlp.gate_proj.weight" || rest == "mlp.up_proj.weight") {
    const int64_t ir = c.inter / c.tp;
    const int64_t row = (rest == "mlp.up_proj.weight" ? ir : 0) + i % ir;
    per_rank.push_back({static_cast<int>(i / ir), {prefix + "mlp.gate_up_proj.weight", row * cols + j}});
  } else if (rest.find(".experts.") != std::string::npos) {
    const std::string block = rest.substr(0, rest.find('.'));
    const size_t e0 = rest.find(".experts.") + 9;
    const int64_t e = std::stoll(rest.substr(e0));
    const std::string part = rest.substr(rest.find('.', e0) + 1);
    const int64_t el = c.experts / c.ep, mtp = c.tp / c.ep, il = c.mi / mtp, group = e / el;
    if (part == "gate_proj.weight" || part == "w1.weight" || part == "up_proj.weight" || part == "w3.weight") {
      const bool up = part == "up_proj.weight" || part == "w3.weight";
      const int64_t row = (up ? il : 0) + i % il;
      per_rank.push_back({static_cast<int>(group * mtp + i / il),
                          {prefix + block + ".experts.w13_weight", ((e % el) * 2 * il + row) * c.h + j}});
    } else if (part == "down_proj.weight" || part == "w2.weight") {
      per_rank.push_back({static_cast<int>(group * mtp + j / il),
                          {prefix + block + ".experts.w2_weight", ((e % el) * c.h + i) * il + j % il}});
    }
  }
  for (int rep = 0; rep < c.replicas; ++rep) {
    for (const auto& [r, pf] : per_rank) out->push_back({rep * c.tp + r, pf.first, pf.second});
  }
}

Reassembled reassemble(const Manifest& manifest, const std::vector<RankSpec>& ranks, const Plan& plan) {
  Reassembled out;
  out.values.resize(ranks.size());
  out.writes.resize(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) {
    for (const ParamSpec& p : ranks[d].params) {
      out.values[d].emplace_back(static_cast<size_t>(numel(p.shape)), 0);
      out.writes[d].emplace_back(static_cast<size_t>(numel(p.shape)), 0);
    }
  }
  for (const Piece& pc : plan.pieces) {
    const ParamSpec& p = ranks[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)];
    const SourceSlice& sl = p.slices[static_cast<size_t>(pc.slice)];
    const Shape& src_shape = manifest[static_cast<size_t>(pc.source)].shape;
    // A piece is its slice's source box, or a part of it (cut by the holders' boxes).
    const auto part = intersect(pc.src, sl.src);
    if (manifest[static_cast<size_t>(pc.source)].name != sl.source || !part || !(*part == pc.src)) {
      out.error = fmt::format("piece for {} is not inside its slice", p.name);
      return out;
    }
    const size_t k = src_shape.size(), n = p.shape.size();
    // Walk the source box in row-major order.
    Shape idx = pc.src.offset;
    const int64_t count = numel(pc.src.size);
    for (int64_t e = 0; e < count; ++e) {
      int64_t sflat = 0, dflat = 0;
      for (size_t a = 0; a < k; ++a) sflat = sflat * src_shape[a] + idx[a];
      for (size_t a = 0; a < n; ++a) {
        int64_t pos = sl.dst_offset[a];
        if (a >= n - k) pos += idx[a - (n - k)] - sl.src.offset[a - (n - k)];
        if (pos < 0 || pos >= p.shape[a]) {
          out.error = fmt::format("piece of {} lands outside {}", sl.source, p.name);
          return out;
        }
        dflat = dflat * p.shape[a] + pos;
      }
      out.values[static_cast<size_t>(pc.dst)][static_cast<size_t>(pc.param)][static_cast<size_t>(dflat)] =
          source_value(pc.source, sflat);
      ++out.writes[static_cast<size_t>(pc.dst)][static_cast<size_t>(pc.param)][static_cast<size_t>(dflat)];
      for (size_t a = k; a-- > 0;) {
        if (++idx[a] < pc.src.offset[a] + pc.src.size[a]) break;
        idx[a] = pc.src.offset[a];
      }
    }
  }
  return out;
}

std::string check_against_oracle(const TCfg& c, const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                 const Reassembled& r) {
  if (!r.error.empty()) return r.error;
  if (ranks.size() != static_cast<size_t>(c.tp * c.replicas)) return "wrong number of ranks";
  std::vector<std::map<std::string, size_t>> param_index(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) {
    for (size_t p = 0; p < ranks[d].params.size(); ++p) param_index[d][ranks[d].params[p].name] = p;
  }
  int64_t expected_writes = 0;
  std::vector<Place> places;
  for (size_t s = 0; s < manifest.size(); ++s) {
    const int64_t n = numel(manifest[s].shape);
    for (int64_t f = 0; f < n; ++f) {
      places.clear();
      expected_places(c, manifest[s].name, manifest[s].shape, f, &places);
      if (places.empty()) return fmt::format("the oracle does not know {}", manifest[s].name);
      for (const Place& pl : places) {
        auto it = param_index[static_cast<size_t>(pl.rank)].find(pl.param);
        if (it == param_index[static_cast<size_t>(pl.rank)].end()) {
          return fmt::format("rank {} has no parameter {}", pl.rank, pl.param);
        }
        const auto& vals = r.values[static_cast<size_t>(pl.rank)][it->second];
        const auto& w = r.writes[static_cast<size_t>(pl.rank)][it->second];
        if (pl.flat >= static_cast<int64_t>(vals.size())) return fmt::format("{} is smaller than the oracle says", pl.param);
        if (w[static_cast<size_t>(pl.flat)] != 1 || vals[static_cast<size_t>(pl.flat)] != source_value(static_cast<int>(s), f)) {
          return fmt::format("{}[{}] -> rank {} {}[{}]: written {} times, value {:#x}", manifest[s].name, f, pl.rank,
                             pl.param, pl.flat, w[static_cast<size_t>(pl.flat)], vals[static_cast<size_t>(pl.flat)]);
        }
        ++expected_writes;
      }
    }
  }
  int64_t writes = 0;
  for (const auto& rank : r.writes) {
    for (const auto& p : rank) {
      for (int w : p) writes += w;
    }
  }
  if (writes != expected_writes) return fmt::format("{} elements written, the layout places {}", writes, expected_writes);
  return "";
}

}  // namespace ferry::sharding::testing

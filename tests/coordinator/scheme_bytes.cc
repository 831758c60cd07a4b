#include "tests/coordinator/scheme_bytes.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/kernels/ref_quantize.h"
#include "tests/sharding/oracle.h"

namespace ferry::testutil {

namespace kt = kernels::testing;

// A two-layer model of 8 heads and a vocabulary of 300 (which no TP size here divides).
Config config(std::string name, int tp, int64_t hidden, int64_t kv_heads, int64_t head_dim, int64_t intermediate) {
  Config c{std::move(name), {}, tp};
  c.llama.hidden_size = hidden;
  c.llama.num_heads = 8;
  c.llama.num_kv_heads = kv_heads;
  c.llama.head_dim = head_dim;
  c.llama.intermediate_size = intermediate;
  c.llama.vocab_size = 300;
  c.llama.num_layers = 2;
  return c;
}

// TP 2 with more KV heads than ranks (two per rank); the vocabulary of 300 pads each rank's shard
// to 192 rows, the last rank's 42 of them padding.
Config kv_above_tp() { return config("Tp2Kv4", 2, 128, 4, 32, 256); }

// TP 4 with two KV heads: each KV head is replicated on two ranks. Vocabulary shards of 128 rows:
// rank 2 holds 44 real rows and rank 3 none at all (all padding).
Config kv_below_tp() { return config("Tp4Kv2", 4, 128, 2, 64, 512); }

// Large enough that each rank's update is several buckets: a bucket holds FERRY_BUCKET_BYTES of
// payload plus the sender's room for headers (about 1 MiB), and each rank here takes about 2.5 MB.
Config several_buckets() { return config("Tp2Kv4Wide", 2, 256, 4, 64, 1024); }

sharding::testing::TCfg oracle_cfg(const Config& c) {
  sharding::testing::TCfg t;
  t.h = c.llama.hidden_size;
  t.nh = c.llama.num_heads;
  t.kv = c.llama.num_kv_heads;
  t.hd = c.llama.effective_head_dim();
  t.inter = c.llama.intermediate_size;
  t.vocab = c.llama.vocab_size;
  t.layers = c.llama.num_layers;
  t.tie = c.llama.tie_word_embeddings;
  t.tp = c.tp;
  t.pad = c.llama.vocab_pad_multiple;
  t.replicas = 1;
  return t;
}

float bf16_value(uint16_t b) { return static_cast<float>(kernels::testref::decode_bf16(b)); }

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// The seeded checkpoint of cluster.h with values that make the schemes' corner cases matter: gate
// and up (and q, k, v) of different magnitudes, so one scale over a fused parameter would be
// wrong; an outlier in one KV head; a zero row (amax 0, scale 1); NaN and infinities.
Checkpoint make_checkpoint(const sharding::Manifest& m, uint64_t seed) {
  Checkpoint ck(m, seed);
  auto scale = [&](const std::string& name, float by) {
    for (auto& b : ck.data.at(name)) b = bf16_bits(bf16_value(b) * by);
  };
  scale("model.layers.0.mlp.up_proj.weight", 16.0f);
  scale("model.layers.1.self_attn.v_proj.weight", 0.25f);
  scale("model.layers.1.self_attn.q_proj.weight", 4.0f);
  auto& k1 = ck.data.at("model.layers.1.self_attn.k_proj.weight");
  k1[k1.size() - 5] = bf16_bits(40.0f);  // last KV head
  auto& gate1 = ck.data.at("model.layers.1.mlp.gate_proj.weight");
  const size_t h = static_cast<size_t>(m.front().shape[1]);
  std::fill(gate1.begin() + static_cast<std::ptrdiff_t>(3 * h), gate1.begin() + static_cast<std::ptrdiff_t>(4 * h),
            uint16_t{0});
  auto& q0 = ck.data.at("model.layers.0.self_attn.q_proj.weight");
  q0[7] = 0x7FC0;          // NaN
  q0[h + 9] = 0xFF80;      // -inf
  q0[2 * h + 2] = 0x7F80;  // +inf
  return ck;
}



std::shared_ptr<const std::map<std::string, Places>> oracle_places(const Config& c,
                                                                  const std::vector<sharding::RankSpec>& specs) {
  auto out = std::make_shared<std::map<std::string, Places>>();
  const auto t = oracle_cfg(c);
  std::vector<sharding::testing::Place> found;
  for (const auto& src : sharding::llama_manifest(c.llama)) {
    Places& per = (*out)[src.name];
    const int64_t n = shape_numel(src.shape);
    per.start.reserve(static_cast<size_t>(n) + 1);
    per.dest.reserve(static_cast<size_t>(n));
    for (int64_t e = 0; e < n; ++e) {
      per.start.push_back(static_cast<uint32_t>(per.dest.size()));
      found.clear();
      sharding::testing::expected_places(t, src.name, src.shape, e, &found);
      if (found.empty()) {
        ADD_FAILURE() << src.name << " element " << e << " lands nowhere";
        return out;
      }
      for (const auto& p : found) {
        const auto& params = specs.at(static_cast<size_t>(p.rank)).params;
        auto it = std::find_if(params.begin(), params.end(), [&](const auto& q) { return q.name == p.param; });
        if (it == params.end()) {
          ADD_FAILURE() << "rank " << p.rank << " has no parameter " << p.param;
          return out;
        }
        per.dest.push_back({p.rank, static_cast<int32_t>(it - params.begin()), p.flat});
      }
    }
    per.start.push_back(static_cast<uint32_t>(per.dest.size()));
  }
  return out;
}

Layout make_layout(const Config& c, const std::string& scheme) {
  Layout l;
  for (int r = 0; r < c.tp; ++r) {
    auto spec = sharding::llama_rank_spec(c.llama, r, c.tp, *parse_scheme(scheme));
    EXPECT_TRUE(spec.ok()) << spec.status().to_string();
    if (!spec.ok()) return l;
    l.specs.push_back(std::move(*spec));
  }
  // The places do not depend on the scheme: computed once per configuration.
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const std::map<std::string, Places>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& places = cache[c.name];
  if (!places) places = oracle_places(c, l.specs);
  l.places = places;
  return l;
}

bool is_linear(const std::string& param) {
  for (const char* s : {".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight"}) {
    if (param.ends_with(s)) return true;
  }
  return false;
}

// The logical shards of a fused parameter from the model's dimensions: q | k | v rows (one KV head
// per rank when KV heads are replicated), gate | up rows.
std::vector<int64_t> own_shard_rows(const Config& c, const std::string& param) {
  const auto& m = c.llama;
  if (param.ends_with(".qkv_proj.weight")) {
    const int64_t kv_local = m.num_kv_heads >= c.tp ? m.num_kv_heads / c.tp : 1;
    const int64_t hd = m.effective_head_dim();
    return {m.num_heads / c.tp * hd, kv_local * hd, kv_local * hd};
  }
  if (param.ends_with(".gate_up_proj.weight")) return {m.intermediate_size / c.tp, m.intermediate_size / c.tp};
  return {};
}

// A rank's full-precision shape of each parameter, from the model's dimensions; empty for a name
// the model does not have.
Shape own_shape(const Config& c, const std::string& param) {
  const auto& m = c.llama;
  const int64_t h = m.hidden_size, hd = m.effective_head_dim();
  if (param == "model.embed_tokens.weight" || param == "lm_head.weight") {
    // vLLM's VocabParallelEmbedding: the vocabulary padded, then split evenly.
    return {(m.vocab_size + m.vocab_pad_multiple - 1) / m.vocab_pad_multiple * m.vocab_pad_multiple / c.tp, h};
  }
  if (param == "model.norm.weight" || param.ends_with("layernorm.weight")) return {h};
  if (param.ends_with(".qkv_proj.weight")) {
    const auto r = own_shard_rows(c, param);
    return {r[0] + r[1] + r[2], h};
  }
  if (param.ends_with(".o_proj.weight")) return {h, m.num_heads * hd / c.tp};
  if (param.ends_with(".gate_up_proj.weight")) return {2 * m.intermediate_size / c.tp, h};
  if (param.ends_with(".down_proj.weight")) return {h, m.intermediate_size / c.tp};
  return {};
}


std::string scale_name(const std::string& param) { return param.substr(0, param.size() - 6) + "weight_scale"; }

// Every storage tensor of every rank, expected after `ck` lands under `scheme`.
std::vector<RankBytes> expected_storage(const Config& c, const Layout& l, Scheme scheme, const Checkpoint& ck) {
  std::vector<std::vector<std::vector<uint16_t>>> full(l.specs.size());
  for (size_t r = 0; r < l.specs.size(); ++r) {
    for (const auto& p : l.specs[r].params) full[r].emplace_back(static_cast<size_t>(shape_numel(p.shape)), 0);
  }
  for (const auto& [name, per] : *l.places) {
    const auto& src = ck.data.at(name);
    for (size_t e = 0; e + 1 < per.start.size(); ++e) {
      for (uint32_t k = per.start[e]; k < per.start[e + 1]; ++k) {
        const Dest& d = per.dest[k];
        full[static_cast<size_t>(d.rank)][static_cast<size_t>(d.param)][static_cast<size_t>(d.flat)] = src[e];
      }
    }
  }
  std::vector<RankBytes> out(l.specs.size());
  for (size_t r = 0; r < l.specs.size(); ++r) {
    for (size_t i = 0; i < l.specs[r].params.size(); ++i) {
      const auto& p = l.specs[r].params[i];
      const bool linear = is_linear(p.name);
      const Scheme s = linear ? scheme : Scheme::kNone;
      EXPECT_EQ(p.scheme, s) << p.name;
      EXPECT_EQ(p.shape, own_shape(c, p.name)) << p.name;
      const std::vector<int64_t> shards = own_shard_rows(c, p.name);
      if (!shards.empty()) {
        EXPECT_EQ(p.shard_rows, shards) << p.name;
      }
      kt::HostTensor in;
      in.dtype = DType::kBF16;
      in.shape = p.shape;
      const auto& v = full[r][i];
      in.bytes.resize(v.size() * 2);
      std::memcpy(in.bytes.data(), v.data(), in.bytes.size());
      for (uint16_t b : v) in.values.push_back(bf16_value(b));
      auto q = kt::ref_quantize(s, in, p.shard_rows, DType::kBF16);
      EXPECT_FALSE(q.empty()) << p.name;
      if (q.empty()) continue;
      out[r][p.name] = std::move(q[0]);
      if (q.size() > 1) out[r][scale_name(p.name)] = std::move(q[1]);
      EXPECT_LE(q.size(), 2u) << p.name;
    }
  }
  return out;
}

RankBytes storage_bytes(const Rank& rank) {
  RankBytes out;
  for (const auto& [name, v] : rank.storage->tensors()) {
    const auto* d = static_cast<const uint8_t*>(v.data());
    out[name] = Bytes(d, d + v.nbytes());
  }
  return out;
}

// "" when `got` holds exactly the tensors of `want` with the same bytes; else the differences.
std::string compare(const RankBytes& want, const RankBytes& got) {
  std::string diff;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      diff += fmt::format("  {}: not in storage\n", name);
      continue;
    }
    const Bytes& g = it->second;
    if (g.size() != w.size()) {
      diff += fmt::format("  {}: {} bytes in storage, {} expected\n", name, g.size(), w.size());
      continue;
    }
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (g[i] != w[i] && bad++ == 0) first = i;
    }
    if (bad) {
      diff += fmt::format("  {}: {} of {} bytes differ, first at {} (0x{:02x}, expected 0x{:02x})\n", name, bad, w.size(),
                          first, g[first], w[first]);
    }
  }
  for (const auto& [name, g] : got) {
    if (!want.count(name)) diff += fmt::format("  {}: in storage, not expected\n", name);
  }
  return diff;
}

// Bytes that differ between two tensors of the same size.
size_t differing(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// Fills every storage tensor of every rank with garbage, so that an update must write each byte
// (padding rows and scales included) for the comparison to pass.
void scribble(Cluster& c) {
  for (int r = 0; r < c.tp(); ++r) {
    for (const auto& [name, v] : c.rank(r).storage->tensors()) std::memset(v.data(), 0xA5, v.nbytes());
  }
}

void expect_storage(Cluster& c, const std::vector<RankBytes>& want, const std::string& what, int replica) {
  for (int r = 0; r < c.tp(); ++r) {
    const std::string diff = compare(want[static_cast<size_t>(r)], storage_bytes(c.rank(replica * c.tp() + r)));
    EXPECT_EQ(diff, "") << what << ", replica " << replica << " rank " << r << ":\n" << diff;
  }
}

}  // namespace ferry::testutil

// Storage bytes after a real update, for every online quantization scheme: a trainer and a TP
// replica over real sockets, and every registered storage tensor of every rank compared byte for
// byte with an expectation built without ferry's sharding or kernels: each rank's full-precision
// parameter from the test-side layout oracle (tests/sharding/oracle.h, vLLM's TP layout), quantized
// by the test-side reference quantizer (tests/kernels/ref_quantize.h).
//
// Then FERRY_VERIFY end to end: one payload byte of one bucket flipped between sealing and posting
// fails the update with DataLoss and leaves the layers that bucket fed untouched, the next clean
// update lands byte-exact, and without FERRY_VERIFY the same flip lands in storage unnoticed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/scoped_env.h"

#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "dataplane/bucket.h"
#include "dataplane/bucket_sender.h"
#include "tests/coordinator/cluster.h"
#include "tests/kernels/ref_quantize.h"
#include "tests/sharding/oracle.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;
namespace kt = kernels::testing;

// Dimensions every online scheme accepts on every rank: each linear's per-rank columns (hidden
// size, heads * head_dim / tp, intermediate / tp) a multiple of 128 (int4 groups, fp8 blocks).
struct Config {
  std::string name;
  sharding::LlamaConfig llama;
  int tp = 1;
};

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

// Where every element of one checkpoint tensor lands, from the oracle: the places of element e are
// dest[start[e]] .. dest[start[e + 1]).
struct Dest {
  int32_t rank;
  int32_t param;  // index in the rank's parameters
  int64_t flat;   // element of the rank's parameter
};
struct Places {
  std::vector<uint32_t> start;
  std::vector<Dest> dest;
};

// The ranks' parameter lists (names, shapes, shard rows: what the storage is registered from) and
// where every checkpoint element lands in them.
struct Layout {
  std::vector<sharding::RankSpec> specs;
  std::shared_ptr<const std::map<std::string, Places>> places;  // by checkpoint name
};

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
    const int64_t per = (m.vocab_size + c.tp - 1) / c.tp;
    return {(per + m.vocab_pad_multiple - 1) / m.vocab_pad_multiple * m.vocab_pad_multiple, h};
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

using Bytes = std::vector<uint8_t>;
using RankBytes = std::map<std::string, Bytes>;  // storage tensor name -> bytes

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

void expect_storage(Cluster& c, const std::vector<RankBytes>& want, const std::string& what) {
  for (int r = 0; r < c.tp(); ++r) {
    const std::string diff = compare(want[static_cast<size_t>(r)], storage_bytes(c.rank(r)));
    EXPECT_EQ(diff, "") << what << ", rank " << r << ":\n" << diff;
  }
}

// ---------------------------------------------------------------------------------------------
// Every online scheme x {KV heads above TP, below TP}.

struct Case {
  Scheme scheme;
  Config (*config)();
};

void PrintTo(const Case& c, std::ostream* os) { *os << scheme_name(c.scheme) << " " << c.config().name; }

class SchemeBytes : public ::testing::TestWithParam<Case> {};

TEST_P(SchemeBytes, EveryStorageTensorOfEveryRankMatchesTheReference) {
  const Config cfg = GetParam().config();
  const Scheme scheme = GetParam().scheme;
  const std::string name(scheme_name(scheme));
  const Layout layout = make_layout(cfg, name);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Cluster c(cfg.tp, name, cfg.llama);
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  scribble(c);

  // Two versions into the same storage: the second overwrites every byte of the first.
  for (uint64_t v = 1; v <= 2; ++v) {
    const Checkpoint ck = make_checkpoint(c.manifest(), 100 + v);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    expect_storage(c, expected_storage(cfg, layout, scheme, ck), fmt::format("{} v{}", name, v));
    for (int i = 0; i < c.tp(); ++i) {
      EXPECT_EQ(c.rank(i).worker->weight_version(), v);
      EXPECT_TRUE(c.rank(i).worker->consistent());
    }
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Scheme s : kAllSchemes) {
    if (s == Scheme::kGptqInt4) continue;  // quantized reload, not an online scheme
    out.push_back({s, kv_above_tp});
    out.push_back({s, kv_below_tp});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOnlineSchemes, SchemeBytes, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string s(scheme_name(info.param.scheme));
                           std::erase(s, '_');
                           return s + "_" + info.param.config().name;
                         });

// ---------------------------------------------------------------------------------------------
// FERRY_VERIFY end to end, with a byte flipped in flight.


// Flips one payload byte of the `target`-th bucket (0-based) sent to TP rank `rank` after arm(),
// once; remembers the parameters that bucket carried pieces of.
class Corrupter {
 public:
  Corrupter() {
    dataplane::set_sealed_bucket_hook_for_testing([this](int, int tp_rank, uint8_t* data, size_t size) {
      std::lock_guard<std::mutex> lock(mu_);
      const int seq = seen_[tp_rank]++;
      if (!armed_ || tp_rank != rank_ || seq != target_) return;
      armed_ = false;
      wire::BucketHeader h;
      Status st = dataplane::decode_bucket(data, size, &h);
      if (!st.ok() || h.pieces_size() == 0 || h.pieces(0).ref_alloc() != 0 || h.pieces(0).offset() % 2 != 0) {
        error_ = "bucket to corrupt: " + st.to_string();
        return;
      }
      for (const auto& p : h.pieces()) params_.insert(static_cast<int>(p.param()));
      // The high byte of the first bf16 element: its exponent moves by 2^64 or more.
      data[h.pieces(0).offset() + 1] ^= 0x40;
      first_param_ = static_cast<int>(h.pieces(0).param());
      flipped_ = true;
    });
  }
  ~Corrupter() { dataplane::set_sealed_bucket_hook_for_testing(nullptr); }

  void arm(int rank, int target) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    rank_ = rank;
    target_ = target;
    seen_.clear();
    flipped_ = false;
    params_.clear();
    error_.clear();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }
  // Buckets sent to each TP rank since the last arm() or count().
  void count() {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.clear();
  }
  int seen(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_[rank];
  }
  bool flipped() {
    std::lock_guard<std::mutex> lock(mu_);
    return flipped_;
  }
  std::set<int> params() {
    std::lock_guard<std::mutex> lock(mu_);
    return params_;
  }
  int first_param() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_param_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  bool armed_ = false;
  int rank_ = 0, target_ = 0;
  std::map<int, int> seen_;
  bool flipped_ = false;
  int first_param_ = -1;
  std::set<int> params_;
  std::string error_;
};

// The smallest buckets, so that one rank's update is several buckets and the corrupted one (the
// middle one) feeds only some of its layers.
constexpr const char* kSmallBuckets = "4K";
constexpr int kCorruptRank = 0, kCorruptBucket = 1;

// The storage tensor names of the parameters of `layers` on a rank.
std::set<std::string> tensors_of_layers(const sharding::RankSpec& spec, const std::set<std::string>& layers) {
  std::set<std::string> out;
  for (const auto& p : spec.params) {
    if (!layers.count(p.layer)) continue;
    out.insert(p.name);
    if (is_linear(p.name)) out.insert(scale_name(p.name));
  }
  return out;
}

// A replica that takes several buckets per rank, in fp8_per_channel, with a Corrupter on its links.
class Verify : public ::testing::Test {
 protected:
  static constexpr Scheme scheme = Scheme::kFp8PerChannel;
  ScopedEnv buckets_{"FERRY_BUCKET_BYTES", kSmallBuckets};
  const Config cfg = several_buckets();
  const Layout layout = make_layout(cfg, std::string(scheme_name(scheme)));
  Corrupter corrupt;
  Cluster c{cfg.tp, std::string(scheme_name(scheme)), cfg.llama};  // started by each test
};

TEST_F(Verify, CorruptedBucketFailsWithDataLossAndTheNextUpdateLands) {
  ScopedEnv verify("FERRY_VERIFY", "1");
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();

  const Checkpoint a = make_checkpoint(c.manifest(), 1), b = make_checkpoint(c.manifest(), 2),
                   d = make_checkpoint(c.manifest(), 3);
  corrupt.count();
  auto r = c.update(1, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_GT(corrupt.seen(kCorruptRank), kCorruptBucket + 1) << "buckets too large to corrupt one mid-update";
  const auto want_a = expected_storage(cfg, layout, scheme, a);
  expect_storage(c, want_a, "v1");

  corrupt.arm(kCorruptRank, kCorruptBucket);
  r = c.update(2, b);
  ASSERT_TRUE(corrupt.flipped()) << corrupt.error();
  ASSERT_FALSE(r.ok()) << "a bucket corrupted in flight landed under FERRY_VERIFY=1";
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
  EXPECT_THAT(r.status().message(), HasSubstr("checksum"));
  EXPECT_THAT(r.status().message(), HasSubstr(fmt::format("replica 0 rank {}", kCorruptRank)));

  // Every rank stays paused on v1, marked inconsistent; the corrupted bucket's layers on its rank
  // hold v1's bytes exactly.
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_TRUE(c.rank(i).worker->paused()) << "rank " << i;
    EXPECT_FALSE(c.rank(i).worker->consistent()) << "rank " << i;
    EXPECT_EQ(c.rank(i).resumes, 1) << "rank " << i;
    EXPECT_EQ(c.rank(i).last_resume, 1u) << "rank " << i;
  }
  const auto& spec = layout.specs[kCorruptRank];
  std::set<std::string> hit_layers;
  for (int p : corrupt.params()) hit_layers.insert(spec.params.at(static_cast<size_t>(p)).layer);
  ASSERT_FALSE(hit_layers.empty());
  const auto want_b = expected_storage(cfg, layout, scheme, b);
  const RankBytes now = storage_bytes(c.rank(kCorruptRank));
  for (const std::string& t : tensors_of_layers(spec, hit_layers)) {
    SCOPED_TRACE(t);
    EXPECT_EQ(differing(now.at(t), want_a[kCorruptRank].at(t)), 0u) << "a layer the corrupted bucket fed changed";
    EXPECT_GT(differing(want_b[kCorruptRank].at(t), want_a[kCorruptRank].at(t)), 0u);  // else that proves nothing
  }

  // The next clean update lands byte-exact and resumes every rank.
  corrupt.disarm();
  r = c.update(3, d);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_storage(c, expected_storage(cfg, layout, scheme, d), "v3 after the corrupted v2");
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_FALSE(c.rank(i).worker->paused()) << "rank " << i;
    EXPECT_TRUE(c.rank(i).worker->consistent()) << "rank " << i;
    EXPECT_EQ(c.rank(i).last_resume, 3u) << "rank " << i;
  }
}

// The contrast: without FERRY_VERIFY the same flip is not caught. The update succeeds, and the
// corrupted parameter, and nothing else, differs from the reference in storage.
TEST_F(Verify, WithoutVerifyTheSameCorruptionLandsUnnoticed) {
  ScopedEnv verify("FERRY_VERIFY", "0");
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();

  const Checkpoint a = make_checkpoint(c.manifest(), 1), b = make_checkpoint(c.manifest(), 2);
  auto r = c.update(1, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_storage(c, expected_storage(cfg, layout, scheme, a), "v1");

  corrupt.arm(kCorruptRank, kCorruptBucket);
  r = c.update(2, b);
  ASSERT_TRUE(corrupt.flipped()) << corrupt.error();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto want_b = expected_storage(cfg, layout, scheme, b);
  const auto& spec = layout.specs[kCorruptRank];
  const std::string victim = spec.params.at(static_cast<size_t>(corrupt.first_param())).name;
  RankBytes now = storage_bytes(c.rank(kCorruptRank));
  std::set<std::string> differ;
  for (const auto& [t, bytes] : want_b[kCorruptRank]) {
    if (differing(now.at(t), bytes)) differ.insert(t);
  }
  std::set<std::string> victim_tensors{victim};
  if (is_linear(victim)) victim_tensors.insert(scale_name(victim));
  EXPECT_FALSE(differ.empty()) << "the flipped byte did not reach storage";
  for (const auto& t : differ) EXPECT_TRUE(victim_tensors.count(t)) << t << " differs, but only " << victim << " was hit";
  for (int i = 0; i < c.tp(); ++i) {
    if (i == kCorruptRank) continue;
    const std::string diff = compare(want_b[static_cast<size_t>(i)], storage_bytes(c.rank(i)));
    EXPECT_EQ(diff, "") << "rank " << i << ":\n" << diff;
  }
}

}  // namespace
}  // namespace ferry::testutil

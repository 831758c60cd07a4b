#include "examples/demo/reference.h"

#include <cmath>
#include <cstring>
#include <random>

namespace demo {
namespace {

float bf16_value(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e4m3fn code whose value is nearest to y (ties to the even code), saturating at +-448.
uint8_t e4m3_nearest(double y) {
  static const std::vector<double> table = [] {
    std::vector<double> t(127);
    for (int c = 0; c < 127; ++c) {
      const int e = c >> 3, m = c & 7;
      t[static_cast<size_t>(c)] = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    }
    return t;
  }();
  const double a = std::fabs(y);
  int best = 0;
  for (int c = 1; c < 127; ++c) {
    const double d = std::fabs(table[static_cast<size_t>(c)] - a), bd = std::fabs(table[static_cast<size_t>(best)] - a);
    if (d < bd || (d == bd && (c & 1) == 0)) best = c;
  }
  if (a > 448.0) best = 126;
  return static_cast<uint8_t>(best | (std::signbit(y) ? 0x80 : 0));
}

// Rows [r0, r0+n) of a 2-D tensor, or elements of a 1-D one, as floats.
std::vector<float> rows(const HostTensor& t, int64_t r0, int64_t n) {
  const int64_t cols = t.shape.size() > 1 ? t.shape[1] : 1;
  std::vector<float> out(static_cast<size_t>(n * cols));
  for (int64_t i = 0; i < n * cols; ++i) out[static_cast<size_t>(i)] = bf16_value(t.bf16[static_cast<size_t>(r0 * cols + i)]);
  return out;
}

std::vector<float> cols(const HostTensor& t, int64_t c0, int64_t n) {
  const int64_t R = t.shape[0], C = t.shape[1];
  std::vector<float> out(static_cast<size_t>(R * n));
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < n; ++j)
      out[static_cast<size_t>(i * n + j)] = bf16_value(t.bf16[static_cast<size_t>(i * C + c0 + j)]);
  return out;
}

std::vector<uint8_t> as_bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    const auto b = static_cast<uint16_t>(u >> 16);  // values came from bf16, so this is exact
    std::memcpy(&out[2 * i], &b, 2);
  }
  return out;
}

// fp8_per_tensor over logical shards: scale = amax / 448 per shard, q = e4m3(x / scale).
void quantize(const std::vector<std::vector<float>>& shards, std::vector<uint8_t>* q, std::vector<uint8_t>* scales) {
  for (const auto& s : shards) {
    float amax = 0;
    for (float x : s) amax = std::fmax(amax, std::fabs(x));
    float scale = static_cast<float>(static_cast<double>(amax) / 448.0);
    if (!(scale > 0)) scale = 1.0f;
    for (float x : s) q->push_back(e4m3_nearest(static_cast<float>(static_cast<double>(x) / scale)));
    uint8_t b[4];
    std::memcpy(b, &scale, 4);
    scales->insert(scales->end(), b, b + 4);
  }
}

std::string L(int64_t i, const char* rest) { return "model.layers." + std::to_string(i) + "." + rest; }

}  // namespace

Checkpoint make_checkpoint(const Model& m, uint64_t version) {
  Checkpoint ck;
  const int64_t h = m.hidden, hd = m.head_dim();
  std::mt19937_64 rng(0x5eed0000 + version);
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float spread) {
    HostTensor t;
    t.shape = shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::normal_distribution<float> dist(0.0f, spread);
    t.bf16.resize(static_cast<size_t>(n));
    for (auto& b : t.bf16) {
      const float f = dist(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      b = static_cast<uint16_t>(u >> 16);
    }
    ck.emplace(name, std::move(t));
  };
  const float v = 1.0f + 0.25f * static_cast<float>(version);
  add("model.embed_tokens.weight", {m.vocab, h}, 0.02f * v);
  for (int64_t i = 0; i < m.layers; ++i) {
    add(L(i, "input_layernorm.weight"), {h}, 1.0f);
    add(L(i, "self_attn.q_proj.weight"), {m.heads * hd, h}, 0.05f * v);
    add(L(i, "self_attn.k_proj.weight"), {m.kv_heads * hd, h}, 0.2f * v);
    add(L(i, "self_attn.v_proj.weight"), {m.kv_heads * hd, h}, 0.01f * v);
    add(L(i, "self_attn.o_proj.weight"), {h, m.heads * hd}, 0.05f * v);
    add(L(i, "post_attention_layernorm.weight"), {h}, 1.0f);
    add(L(i, "mlp.gate_proj.weight"), {m.intermediate, h}, 0.03f * v);
    add(L(i, "mlp.up_proj.weight"), {m.intermediate, h}, 0.3f * v);
    add(L(i, "mlp.down_proj.weight"), {h, m.intermediate}, 0.02f * v);
  }
  add("model.norm.weight", {h}, 1.0f);
  add("lm_head.weight", {m.vocab, h}, 0.02f * v);
  return ck;
}

std::map<std::string, std::vector<uint8_t>> expected_storage(const Model& m, const Checkpoint& ck, int r, int tp) {
  std::map<std::string, std::vector<uint8_t>> out;
  const int64_t hd = m.head_dim(), h = m.hidden;
  const int64_t q_rows = m.heads / tp * hd;
  const int64_t kv_local = m.kv_heads >= tp ? m.kv_heads / tp : 1;
  const int64_t kv0 = m.kv_heads >= tp ? r * kv_local : r * m.kv_heads / tp;
  const int64_t ir = m.intermediate / tp;

  auto vocab = [&](const std::string& name) {
    const int64_t per = ((m.vocab + tp - 1) / tp + m.vocab_pad - 1) / m.vocab_pad * m.vocab_pad;
    const int64_t r0 = std::min(m.vocab, r * per), n = std::min(m.vocab, r0 + per) - r0;
    std::vector<float> v = rows(ck.at(name), r0, n);
    v.resize(static_cast<size_t>(per * h), 0.0f);  // padding rows stay zero
    out[name] = as_bf16_bytes(v);
  };
  auto linear = [&](const std::string& name, const std::vector<std::vector<float>>& shards) {
    std::vector<uint8_t> q, s;
    quantize(shards, &q, &s);
    out[name] = std::move(q);
    out[name.substr(0, name.size() - 6) + "weight_scale"] = std::move(s);
  };

  vocab("model.embed_tokens.weight");
  for (int64_t i = 0; i < m.layers; ++i) {
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      out[L(i, n)] = as_bf16_bytes(rows(ck.at(L(i, n)), 0, h));
    }
    linear(L(i, "self_attn.qkv_proj.weight"), {rows(ck.at(L(i, "self_attn.q_proj.weight")), r * q_rows, q_rows),
                                               rows(ck.at(L(i, "self_attn.k_proj.weight")), kv0 * hd, kv_local * hd),
                                               rows(ck.at(L(i, "self_attn.v_proj.weight")), kv0 * hd, kv_local * hd)});
    linear(L(i, "self_attn.o_proj.weight"), {cols(ck.at(L(i, "self_attn.o_proj.weight")), r * q_rows, q_rows)});
    linear(L(i, "mlp.gate_up_proj.weight"),
           {rows(ck.at(L(i, "mlp.gate_proj.weight")), r * ir, ir), rows(ck.at(L(i, "mlp.up_proj.weight")), r * ir, ir)});
    linear(L(i, "mlp.down_proj.weight"), {cols(ck.at(L(i, "mlp.down_proj.weight")), r * ir, ir)});
  }
  out["model.norm.weight"] = as_bf16_bytes(rows(ck.at("model.norm.weight"), 0, h));
  vocab("lm_head.weight");
  return out;
}

}  // namespace demo

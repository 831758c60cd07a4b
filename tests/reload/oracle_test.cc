// The differential oracle: an engine cold-loaded with weights B and an engine loaded with A and
// then updated to B in place produce bit-identical outputs from their captured programs. The flip
// probe changes outputs on correct code. And the captured decoder agrees with an independent
// float64 forward pass over the dequantized storage.
#include <cmath>

#include "examples/tiny_decoder/decoder.h"
#include "core/float_convert.h"
#include "reload/checkpoint_loader.h"
#include "reload/flip_probe.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::make_rank;

const std::vector<int32_t> kPrompt{5, 99, 3, 250, 17};
constexpr int kNew = 6;

class OracleTest : public ::testing::TestWithParam<Scheme> {};

TEST_P(OracleTest, ColdLoadEqualsUpdateInPlace) {
  const tiny::Config cfg;
  auto cold = make_rank(cfg, GetParam());
  auto warm = make_rank(cfg, GetParam());
  auto a = tiny::Weights::random(cfg, cold->spec, 21);
  auto b = tiny::Weights::random(cfg, cold->spec, 22);
  ASSERT_TRUE(a.ok() && b.ok());

  ASSERT_TRUE(load_checkpoint(*warm->engine, a->checkpoint(), 1).ok());
  auto warm_dec = tiny::Decoder::create(cfg, warm->spec, warm->engine->registry());
  ASSERT_TRUE(warm_dec.ok()) << warm_dec.status().to_string();
  auto out_a = (*warm_dec)->outputs(kPrompt, kNew);
  ASSERT_TRUE(out_a.ok()) << out_a.status().to_string();
  LoadOptions chunked;
  chunked.chunk_rows = 32;
  chunked.shuffle_seed = 9;
  auto r = load_checkpoint(*warm->engine, b->checkpoint(), 2, chunked);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto out_warm = (*warm_dec)->outputs(kPrompt, kNew);
  ASSERT_TRUE(out_warm.ok());

  ASSERT_TRUE(load_checkpoint(*cold->engine, b->checkpoint(), 1).ok());
  auto cold_dec = tiny::Decoder::create(cfg, cold->spec, cold->engine->registry());
  ASSERT_TRUE(cold_dec.ok());
  auto out_cold = (*cold_dec)->outputs(kPrompt, kNew);
  ASSERT_TRUE(out_cold.ok());

  EXPECT_EQ(*out_warm, *out_cold);
  EXPECT_NE(*out_warm, *out_a) << "weights A and B must give different outputs for the oracle to mean anything";
  EXPECT_EQ(testing::contents(warm->storage), testing::contents(cold->storage));
  EXPECT_TRUE(audit((*warm_dec)->program(), warm->engine->registry(), warm->storage.tensors()).clean());
}

TEST_P(OracleTest, FlipProbeChangesOutputsAndRestores) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, GetParam());
  auto a = tiny::Weights::random(cfg, rank->spec, 31);
  auto b = tiny::Weights::random(cfg, rank->spec, 32);
  ASSERT_TRUE(load_checkpoint(*rank->engine, a->checkpoint(), 1).ok());
  auto dec = tiny::Decoder::create(cfg, rank->spec, rank->engine->registry());
  ASSERT_TRUE(dec.ok());
  ASSERT_TRUE(load_checkpoint(*rank->engine, b->checkpoint(), 2).ok());
  auto targets = permutation_tensors(rank->engine->registry());
  if (GetParam() == Scheme::kGptqInt4) {
    EXPECT_EQ(targets.size(), 9u);  // qkv, o, gate_up, down in 2 layers, and the lm_head
  } else {
    EXPECT_TRUE(targets.empty());
    targets = scale_tensors(rank->engine->registry());
  }
  if (targets.empty()) GTEST_SKIP() << scheme_name(GetParam()) << " has neither permutations nor scales to flip";
  const auto before = testing::contents(rank->storage);
  auto run = [&] { return (*dec)->outputs(kPrompt, kNew); };
  auto flip = flip_probe(rank->engine->registry(), targets, run);
  ASSERT_TRUE(flip.ok()) << flip.status().to_string();
  EXPECT_TRUE(flip->changed) << flip->to_string();
  EXPECT_EQ(flip->flipped.size(), targets.size());
  EXPECT_EQ(testing::contents(rank->storage), before);
}

// Float64 forward pass over dequantized storage, independent of the decoder's code.
std::vector<double> reference_logits(const tiny::Config& c, const testing::Rank& r, const std::vector<int32_t>& tokens) {
  auto weight = [&](const std::string& name) {
    const sharding::ParamSpec* p = nullptr;
    for (const auto& q : r.spec.params) p = q.name == name ? &q : p;
    auto layout = *param_layout(*p, DType::kBF16);
    std::vector<TensorView> st;
    for (const auto& t : layout) st.push_back(r.storage.tensors().at(storage_name(name, t.suffix)));
    std::vector<float> w(static_cast<size_t>(shape_numel(p->shape)));
    TensorView out(w.data(), DType::kF32, p->shape);
    const Scheme scheme = p->scheme;
    EXPECT_TRUE(kernels::dequantize(scheme, st, scheme == Scheme::kGptqInt4 ? std::vector<int64_t>{} : p->shard_rows, out)
                    .ok());
    return std::vector<double>(w.begin(), w.end());
  };
  auto vec = [&](const std::string& name) {
    const TensorView& v = r.storage.tensors().at(name);
    std::vector<double> out(static_cast<size_t>(v.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(v.data_as<uint16_t>()[i]);
    return out;
  };
  auto matvec = [](const std::vector<double>& w, const std::vector<double>& x) {
    std::vector<double> y(w.size() / x.size(), 0.0);
    for (size_t n = 0; n < y.size(); ++n) {
      for (size_t k = 0; k < x.size(); ++k) y[n] += w[n * x.size() + k] * x[k];
    }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const std::vector<double>& w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double s = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + c.rms_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
    return y;
  };
  const size_t H = static_cast<size_t>(c.hidden), hd = static_cast<size_t>(c.head_dim);
  const size_t nq = static_cast<size_t>(c.heads) * hd, nkv = static_cast<size_t>(c.kv_heads) * hd;
  auto rot = [&](double* x, size_t pos) {
    for (size_t i = 0; i < hd / 2; ++i) {
      const double a = static_cast<double>(pos) * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / hd);
      const double x1 = x[i], x2 = x[i + hd / 2];
      x[i] = x1 * std::cos(a) - x2 * std::sin(a);
      x[i + hd / 2] = x2 * std::cos(a) + x1 * std::sin(a);
    }
  };
  const auto embed = vec("model.embed_tokens.weight");
  std::vector<std::vector<std::vector<double>>> kc(static_cast<size_t>(c.layers)), vc(static_cast<size_t>(c.layers));
  std::vector<double> logits;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    std::vector<double> x(embed.begin() + tokens[pos] * static_cast<int64_t>(H),
                          embed.begin() + (tokens[pos] + 1) * static_cast<int64_t>(H));
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      auto qkv = matvec(weight(pre + "self_attn.qkv_proj.weight"), norm(x, vec(pre + "input_layernorm.weight")));
      for (size_t h = 0; h < nq / hd + nkv / hd; ++h) rot(qkv.data() + h * hd, pos);
      kc[static_cast<size_t>(l)].emplace_back(qkv.begin() + nq, qkv.begin() + nq + nkv);
      vc[static_cast<size_t>(l)].emplace_back(qkv.begin() + nq + nkv, qkv.end());
      std::vector<double> att(nq);
      for (size_t h = 0; h < nq / hd; ++h) {
        const size_t g = h / static_cast<size_t>(c.heads / c.kv_heads);
        std::vector<double> s(pos + 1);
        double mx = -1e300, sum = 0;
        for (size_t t = 0; t <= pos; ++t) {
          for (size_t i = 0; i < hd; ++i) s[t] += qkv[h * hd + i] * kc[static_cast<size_t>(l)][t][g * hd + i];
          s[t] /= std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[t]);
        }
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (size_t t = 0; t <= pos; ++t) {
          for (size_t i = 0; i < hd; ++i) att[h * hd + i] += s[t] / sum * vc[static_cast<size_t>(l)][t][g * hd + i];
        }
      }
      auto o = matvec(weight(pre + "self_attn.o_proj.weight"), att);
      for (size_t i = 0; i < H; ++i) x[i] += o[i];
      auto gu = matvec(weight(pre + "mlp.gate_up_proj.weight"), norm(x, vec(pre + "post_attention_layernorm.weight")));
      const size_t I = gu.size() / 2;
      std::vector<double> act(I);
      for (size_t i = 0; i < I; ++i) act[i] = gu[i] / (1.0 + std::exp(-gu[i])) * gu[I + i];
      auto d = matvec(weight(pre + "mlp.down_proj.weight"), act);
      for (size_t i = 0; i < H; ++i) x[i] += d[i];
    }
    logits = matvec(weight("lm_head.weight"), norm(x, vec("model.norm.weight")));
  }
  logits.resize(static_cast<size_t>(c.vocab));
  return logits;
}

TEST_P(OracleTest, DecoderMatchesFloat64Reference) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, GetParam());
  auto w = tiny::Weights::random(cfg, rank->spec, 41);
  ASSERT_TRUE(load_checkpoint(*rank->engine, w->checkpoint(), 1).ok());
  auto dec = tiny::Decoder::create(cfg, rank->spec, rank->engine->registry());
  ASSERT_TRUE(dec.ok());
  ASSERT_TRUE((*dec)->generate(kPrompt, 1).ok());
  const auto ref = reference_logits(cfg, *rank, kPrompt);
  const auto& got = (*dec)->last_logits();
  ASSERT_EQ(got.size(), ref.size());
  double scale = 0;
  for (double v : ref) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 0.0);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-3 * scale + 1e-5) << "logit " << i;
}

INSTANTIATE_TEST_SUITE_P(EveryScheme, OracleTest, ::testing::ValuesIn(kAllSchemes),
                         [](const auto& info) { return std::string(scheme_name(info.param)); });

}  // namespace
}  // namespace ferry::reload

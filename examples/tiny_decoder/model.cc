#include "examples/tiny_decoder/model.h"

#include <algorithm>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "core/float_convert.h"
#include "kernels/gptq.h"
#include "reload/model_storage.h"

namespace tiny {

using ferry::DType;
using ferry::Result;
using ferry::Shape;
using ferry::Status;
using ferry::TensorView;

ferry::sharding::LlamaConfig Config::llama() const {
  ferry::sharding::LlamaConfig c;
  c.hidden_size = hidden;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate_size = intermediate;
  c.vocab_size = vocab;
  c.num_layers = layers;
  c.dtype = DType::kBF16;
  c.vocab_pad_multiple = 64;
  return c;
}

Result<ferry::sharding::RankSpec> rank_spec(const Config& cfg, ferry::Scheme scheme) {
  FERRY_ASSIGN_OR_RETURN(auto spec, ferry::sharding::llama_rank_spec(cfg.llama(), 0, 1, scheme));
  // The lm_head is a linear layer too: the decoder's last GEMM runs under the same scheme.
  for (auto& p : spec.params.edit()) {
    if (p.name == "lm_head.weight") p.scheme = scheme;
  }
  return spec;
}

Status Weights::add(const std::string& name, DType dtype, const Shape& shape, TensorView* out) {
  FERRY_ASSIGN_OR_RETURN(ferry::Buffer b, ferry::Buffer::allocate(ferry::dtype_bytes(dtype, ferry::shape_numel(shape))));
  FERRY_ASSIGN_OR_RETURN(*out, b.view(dtype, shape));
  views_[name] = *out;
  buffers_[name] = std::move(b);
  return ferry::ok_status();
}

uint64_t Weights::bytes() const {
  uint64_t n = 0;
  for (const auto& [name, b] : buffers_) n += b.size();
  return n;
}

Result<Weights> Weights::random(const Config& cfg, const ferry::sharding::RankSpec& spec, uint64_t seed) {
  Weights w;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Full-precision tensors of the manifest.
  for (const auto& t : spec.expects) {
    TensorView v;
    FERRY_RETURN_IF_ERROR(w.add(t.name, t.dtype, t.shape, &v));
    const bool norm = t.name.find("norm") != std::string::npos;
    const float scale = norm ? 0.1f : t.name.find("embed") != std::string::npos ? 1.0f : 0.08f;
    auto* p = v.data_as<uint16_t>();
    for (int64_t i = 0; i < v.numel(); ++i) p[i] = ferry::f32_to_bf16((norm ? 1.0f : 0.0f) + scale * normal(rng));
  }
  // Quantized checkpoints for gptq_int4 parameters: codes, scales and an act-order g_idx.
  for (const auto& p : spec.params) {
    if (p.scheme != ferry::Scheme::kGptqInt4) continue;
    FERRY_ASSIGN_OR_RETURN(auto layout, ferry::kernels::gptq_checkpoint_layout(p.shape));
    TensorView q, s, g;
    FERRY_RETURN_IF_ERROR(w.add(ferry::reload::storage_name(p.name, layout[0].suffix), layout[0].dtype, layout[0].shape, &q));
    FERRY_RETURN_IF_ERROR(w.add(ferry::reload::storage_name(p.name, layout[1].suffix), layout[1].dtype, layout[1].shape, &s));
    FERRY_RETURN_IF_ERROR(w.add(ferry::reload::storage_name(p.name, layout[2].suffix), layout[2].dtype, layout[2].shape, &g));
    for (int64_t i = 0; i < q.numel(); ++i) q.data_as<int32_t>()[i] = static_cast<int32_t>(rng());
    std::uniform_real_distribution<float> sd(0.004f, 0.02f);
    for (int64_t i = 0; i < s.numel(); ++i) s.data_as<uint16_t>()[i] = ferry::f32_to_f16(sd(rng));
    const int64_t k = p.shape[1];
    std::vector<int32_t> rows(static_cast<size_t>(k));
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), rng);
    for (int64_t i = 0; i < k; ++i) {
      g.data_as<int32_t>()[rows[static_cast<size_t>(i)]] = static_cast<int32_t>(i / ferry::kGroupSize);
    }
  }
  return w;
}

}  // namespace tiny

#include "examples/tiny_decoder/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/float_convert.h"
#include "kernels/gemm.h"
#include "reload/model_storage.h"
#include "reload/processing.h"
#include "examples/tiny_decoder/step_kernels.h"

namespace tiny {

using ferry::DType;
using ferry::Result;
using ferry::Status;
using ferry::TensorView;
using ferry::reload::baked;
using Exec = ferry::kernels::Exec;

namespace {

float* f32(const TensorView& v) { return v.data_as<float>(); }

void rmsnorm(const float* x, const uint16_t* w, float* out, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * ferry::bf16_to_f32(w[i]);
}

// Rotates pairs (i, i + d/2) of one head by the position's angles.
void rope(float* x, int64_t d, int32_t pos, float theta) {
  for (int64_t i = 0; i < d / 2; ++i) {
    const float freq = std::pow(theta, -2.0f * static_cast<float>(i) / static_cast<float>(d));
    const float a = static_cast<float>(pos) * freq, c = std::cos(a), s = std::sin(a);
    const float x1 = x[i], x2 = x[i + d / 2];
    x[i] = x1 * c - x2 * s;
    x[i + d / 2] = x2 * c + x1 * s;
  }
}

}  // namespace

Result<std::unique_ptr<Decoder>> Decoder::create(const Config& cfg, const ferry::sharding::RankSpec& spec,
                                                 const ferry::reload::LayerRegistry& registry, ferry::Device device) {
#if !FERRY_HAVE_CUDA
  if (!device.is_cpu()) return Status::unavailable("tiny decoder: ferry was built without CUDA");
#endif
  std::unique_ptr<Decoder> d(new Decoder(cfg, device));
  FERRY_ASSIGN_OR_RETURN(d->program_, ferry::reload::CapturedProgram::create(device));
  FERRY_RETURN_IF_ERROR(d->capture(spec, registry));
  return d;
}

Status Decoder::capture(const ferry::sharding::RankSpec& spec, const ferry::reload::LayerRegistry& registry) {
  auto& prog = *program_;
  const Config c = cfg_;
  const int64_t h = c.hidden, hd = c.head_dim, nq = c.heads * hd, nkv = c.kv_heads * hd, inter = c.intermediate;
  FERRY_ASSIGN_OR_RETURN(const auto* embed, registry.find("model.embed_tokens.weight"));
  const int64_t vpad = embed->view.dim(0);
  vpad_ = vpad;
  // On a CUDA device every launch only enqueues on the capturing stream (step_kernels.h and
  // kernels::gemm_async), so the whole step becomes one CUDA graph.
  [[maybe_unused]] const bool gpu = device_.is_cuda();
  FERRY_ASSIGN_OR_RETURN(token_, prog.own(DType::kI32, {1}));
  FERRY_ASSIGN_OR_RETURN(pos_, prog.own(DType::kI32, {1}));
  FERRY_ASSIGN_OR_RETURN(next_, prog.own(DType::kI32, {1}));
  FERRY_ASSIGN_OR_RETURN(TensorView x, prog.own(DType::kF32, {1, h}));
  FERRY_ASSIGN_OR_RETURN(TensorView xn, prog.own(DType::kF32, {1, h}));
  FERRY_ASSIGN_OR_RETURN(TensorView qkv, prog.own(DType::kF32, {1, nq + 2 * nkv}));
  FERRY_ASSIGN_OR_RETURN(TensorView att, prog.own(DType::kF32, {1, nq}));
  FERRY_ASSIGN_OR_RETURN(TensorView o, prog.own(DType::kF32, {1, h}));
  FERRY_ASSIGN_OR_RETURN(TensorView gu, prog.own(DType::kF32, {1, 2 * inter}));
  FERRY_ASSIGN_OR_RETURN(TensorView act, prog.own(DType::kF32, {1, inter}));
  FERRY_ASSIGN_OR_RETURN(logits_view_, prog.own(DType::kF32, {1, vpad}));
  std::vector<TensorView> kcache, vcache;
  for (int64_t l = 0; l < c.layers; ++l) {
    FERRY_ASSIGN_OR_RETURN(TensorView kc, prog.own(DType::kF32, {c.max_seq, nkv}));
    FERRY_ASSIGN_OR_RETURN(TensorView vc, prog.own(DType::kF32, {c.max_seq, nkv}));
    kcache.push_back(kc);
    vcache.push_back(vc);
  }
  const TensorView tok = token_, pos = pos_, next = next_, logits = logits_view_;

  auto norm_weight = [&](const std::string& name) -> Result<TensorView> {
    FERRY_ASSIGN_OR_RETURN(const auto* t, registry.find(name));
    return t->view;
  };
  auto linear = [&](const std::string& name, const TensorView& in, const TensorView& out) -> Status {
    const ferry::sharding::ParamSpec* p = nullptr;
    for (const auto& q : spec.params) p = q.name == name ? &q : p;
    if (!p) return Status::not_found("tiny decoder: the spec has no " + name);
    FERRY_ASSIGN_OR_RETURN(auto layout, ferry::reload::param_layout(*p, DType::kBF16));
    const ferry::Scheme scheme = p->scheme;
    std::vector<TensorView> w;
    std::vector<ferry::reload::BakedPointer> ptrs{baked(in, name + " x"), baked(out, name + " y")};
    for (const auto& t : layout) {
      FERRY_ASSIGN_OR_RETURN(const auto* r, registry.find(ferry::reload::storage_name(p->name, t.suffix)));
      w.push_back(r->view);
      ptrs.push_back(baked(r->view, r->name));
    }
    std::vector<int64_t> shards = scheme == ferry::Scheme::kGptqInt4 ? std::vector<int64_t>{} : p->shard_rows;
    if (scheme == ferry::Scheme::kGptqInt4) checks_.push_back({scheme, w});
    return prog.record("gemm " + name, std::move(ptrs), [=](const Exec& e) {
      return ferry::kernels::gemm_async(scheme, in, w, shards, out, e);
    });
  };

  FERRY_RETURN_IF_ERROR(prog.begin_capture());
  const TensorView table = embed->view;
  FERRY_RETURN_IF_ERROR(prog.record("embed", {baked(tok, "token"), baked(table, embed->name), baked(x, "x")},
                                    [=](const Exec& e) {
                                      if (gpu) {
                                        return tiny::cuda::embed(tok.data_as<int32_t>(), table.data_as<uint16_t>(),
                                                                 vpad, h, f32(x), e.stream);
                                      }
                                      const int32_t t = *tok.data_as<int32_t>();
                                      if (t < 0 || t >= vpad) return Status::out_of_range(fmt::format("token {}", t));
                                      const auto* row = table.data_as<uint16_t>() + t * h;
                                      for (int64_t i = 0; i < h; ++i) f32(x)[i] = ferry::bf16_to_f32(row[i]);
                                      return ferry::ok_status();
                                    }));
  auto record_norm = [&](const std::string& name, const TensorView& in, const TensorView& out) -> Status {
    FERRY_ASSIGN_OR_RETURN(TensorView w, norm_weight(name));
    const float eps = c.rms_eps;
    return prog.record("rmsnorm " + name, {baked(in, "x"), baked(w, name), baked(out, "xn")}, [=](const Exec& e) {
      if (gpu) return tiny::cuda::rmsnorm(f32(in), w.data_as<uint16_t>(), f32(out), h, eps, e.stream);
      rmsnorm(f32(in), w.data_as<uint16_t>(), f32(out), h, eps);
      return ferry::ok_status();
    });
  };
  auto record_add = [&](const TensorView& acc, const TensorView& add) -> Status {
    return prog.record("residual", {baked(acc, "x"), baked(add, "delta")}, [=](const Exec& e) {
      if (gpu) return tiny::cuda::residual(f32(acc), f32(add), h, e.stream);
      for (int64_t i = 0; i < h; ++i) f32(acc)[i] += f32(add)[i];
      return ferry::ok_status();
    });
  };
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string pre = fmt::format("model.layers.{}.", l);
    FERRY_RETURN_IF_ERROR(record_norm(pre + "input_layernorm.weight", x, xn));
    FERRY_RETURN_IF_ERROR(linear(pre + "self_attn.qkv_proj.weight", xn, qkv));
    const TensorView kc = kcache[static_cast<size_t>(l)], vc = vcache[static_cast<size_t>(l)];
    FERRY_RETURN_IF_ERROR(prog.record(
        "attention " + pre, {baked(qkv, "qkv"), baked(pos, "pos"), baked(kc, "k cache"), baked(vc, "v cache"),
                             baked(att, "attention out")},
        [=](const Exec& e) {
          if (gpu) {
            return tiny::cuda::attention(f32(qkv), pos.data_as<int32_t>(), f32(kc), f32(vc), f32(att),
                                         static_cast<int>(c.heads), static_cast<int>(c.kv_heads),
                                         static_cast<int>(hd), static_cast<int>(c.max_seq), c.rope_theta, e.stream);
          }
          const int32_t p = *pos.data_as<int32_t>();
          if (p < 0 || p >= c.max_seq) return Status::out_of_range(fmt::format("position {}", p));
          float* q = f32(qkv);
          for (int64_t i = 0; i < c.heads; ++i) rope(q + i * hd, hd, p, c.rope_theta);
          for (int64_t i = 0; i < c.kv_heads; ++i) rope(q + nq + i * hd, hd, p, c.rope_theta);
          std::memcpy(f32(kc) + p * nkv, q + nq, static_cast<size_t>(nkv) * sizeof(float));
          std::memcpy(f32(vc) + p * nkv, q + nq + nkv, static_cast<size_t>(nkv) * sizeof(float));
          const float inv = 1.0f / std::sqrt(static_cast<float>(hd));
          std::vector<float> s(static_cast<size_t>(p) + 1);
          for (int64_t head = 0; head < c.heads; ++head) {
            const int64_t kvh = head / (c.heads / c.kv_heads);
            float mx = -INFINITY, sum = 0.0f;
            for (int32_t t = 0; t <= p; ++t) {
              float dot = 0.0f;
              for (int64_t i = 0; i < hd; ++i) dot += q[head * hd + i] * f32(kc)[t * nkv + kvh * hd + i];
              s[static_cast<size_t>(t)] = dot * inv;
              mx = std::max(mx, dot * inv);
            }
            for (auto& v : s) sum += (v = std::exp(v - mx));
            float* out = f32(att) + head * hd;
            for (int64_t i = 0; i < hd; ++i) {
              float acc = 0.0f;
              for (int32_t t = 0; t <= p; ++t) acc += s[static_cast<size_t>(t)] * f32(vc)[t * nkv + kvh * hd + i];
              out[i] = acc / sum;
            }
          }
          return ferry::ok_status();
        }));
    FERRY_RETURN_IF_ERROR(linear(pre + "self_attn.o_proj.weight", att, o));
    FERRY_RETURN_IF_ERROR(record_add(x, o));
    FERRY_RETURN_IF_ERROR(record_norm(pre + "post_attention_layernorm.weight", x, xn));
    FERRY_RETURN_IF_ERROR(linear(pre + "mlp.gate_up_proj.weight", xn, gu));
    FERRY_RETURN_IF_ERROR(prog.record("swiglu " + pre, {baked(gu, "gate_up"), baked(act, "act")}, [=](const Exec& e) {
      if (gpu) return tiny::cuda::swiglu(f32(gu), f32(act), inter, e.stream);
      for (int64_t i = 0; i < inter; ++i) {
        const float g = f32(gu)[i], u = f32(gu)[inter + i];
        f32(act)[i] = g / (1.0f + std::exp(-g)) * u;
      }
      return ferry::ok_status();
    }));
    FERRY_RETURN_IF_ERROR(linear(pre + "mlp.down_proj.weight", act, o));
    FERRY_RETURN_IF_ERROR(record_add(x, o));
  }
  FERRY_RETURN_IF_ERROR(record_norm("model.norm.weight", x, xn));
  FERRY_RETURN_IF_ERROR(linear("lm_head.weight", xn, logits));
  const int64_t vocab = c.vocab;
  FERRY_RETURN_IF_ERROR(prog.record("argmax", {baked(logits, "logits"), baked(next, "next")}, [=](const Exec& e) {
    if (gpu) return tiny::cuda::argmax(f32(logits), vocab, next.data_as<int32_t>(), e.stream);
    int32_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) best = f32(logits)[i] > f32(logits)[best] ? static_cast<int32_t>(i) : best;
    *next.data_as<int32_t>() = best;
    return ferry::ok_status();
  }));
  return prog.end_capture();
}

Result<int32_t> Decoder::step(int32_t token, int32_t pos) {
  if (device_.is_cpu()) {
    *token_.data_as<int32_t>() = token;
    *pos_.data_as<int32_t>() = pos;
    FERRY_RETURN_IF_ERROR(program_->replay());
    return *next_.data_as<int32_t>();
  }
  // The graph reads token and position from its own device memory; the kernels cannot return an
  // error, so the host checks them first.
  if (token < 0 || token >= vpad_) return Status::out_of_range(fmt::format("token {}", token));
  if (pos < 0 || pos >= cfg_.max_seq) return Status::out_of_range(fmt::format("position {}", pos));
  using ferry::reload::copy_bytes;
  FERRY_RETURN_IF_ERROR(copy_bytes(token_.data(), device_, &token, ferry::Device::cpu(), sizeof(token)));
  FERRY_RETURN_IF_ERROR(copy_bytes(pos_.data(), device_, &pos, ferry::Device::cpu(), sizeof(pos)));
  FERRY_RETURN_IF_ERROR(program_->replay());
  // A gptq GEMM that gave up (a workspace left non-zero) leaves a flag; gemm_check reads it.
  for (const auto& c : checks_) FERRY_RETURN_IF_ERROR(ferry::kernels::gemm_check(c.scheme, c.weight));
  int32_t next = 0;
  FERRY_RETURN_IF_ERROR(copy_bytes(&next, ferry::Device::cpu(), next_.data(), device_, sizeof(next)));
  return next;
}

Result<std::vector<int32_t>> Decoder::generate(const std::vector<int32_t>& prompt, int new_tokens) {
  if (prompt.empty()) return Status::invalid_argument("tiny decoder: empty prompt");
  if (static_cast<int64_t>(prompt.size()) + new_tokens > cfg_.max_seq) {
    return Status::invalid_argument(fmt::format("tiny decoder: {} + {} tokens exceed max_seq {}", prompt.size(),
                                                new_tokens, cfg_.max_seq));
  }
  std::vector<int32_t> out;
  int32_t next = 0, pos = 0;
  for (int32_t t : prompt) {
    FERRY_ASSIGN_OR_RETURN(next, step(t, pos++));
  }
  for (int i = 0; i < new_tokens; ++i) {
    out.push_back(next);
    if (i + 1 < new_tokens) {
      FERRY_ASSIGN_OR_RETURN(next, step(next, pos++));
    }
  }
  logits_.resize(static_cast<size_t>(cfg_.vocab));
  FERRY_RETURN_IF_ERROR(ferry::reload::copy_bytes(logits_.data(), ferry::Device::cpu(), logits_view_.data(), device_,
                                                  logits_.size() * sizeof(float)));
  return out;
}

Result<std::vector<uint8_t>> Decoder::outputs(const std::vector<int32_t>& prompt, int new_tokens) {
  FERRY_ASSIGN_OR_RETURN(auto tokens, generate(prompt, new_tokens));
  std::vector<uint8_t> out(tokens.size() * sizeof(int32_t) + logits_.size() * sizeof(float));
  std::memcpy(out.data(), tokens.data(), tokens.size() * sizeof(int32_t));
  std::memcpy(out.data() + tokens.size() * sizeof(int32_t), logits_.data(), logits_.size() * sizeof(float));
  return out;
}

}  // namespace tiny

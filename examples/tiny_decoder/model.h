// The tiny decoder's model: a Llama-shaped configuration small enough for a unit test, its rank
// spec (TP 1, every linear layer under one quantization scheme), and seeded random weights in
// checkpoint format (full precision for online schemes; qweight/scales/g_idx for gptq_int4).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/buffer.h"
#include "reload/checkpoint_loader.h"
#include "sharding/llama.h"

namespace tiny {

struct Config {
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 32;
  int64_t intermediate = 256;
  int64_t vocab = 256;
  int64_t layers = 2;
  int64_t max_seq = 32;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;

  ferry::sharding::LlamaConfig llama() const;
};

// TP rank 0 of 1; linear layers (qkv, o, gate_up, down, lm_head) use `scheme`.
ferry::Result<ferry::sharding::RankSpec> rank_spec(const Config& cfg, ferry::Scheme scheme);

// Weights for `spec` in checkpoint format, drawn from `seed`. Owns its buffers.
class Weights {
 public:
  static ferry::Result<Weights> random(const Config& cfg, const ferry::sharding::RankSpec& spec, uint64_t seed);
  const ferry::reload::Checkpoint& checkpoint() const { return views_; }
  uint64_t bytes() const;

 private:
  ferry::Status add(const std::string& name, ferry::DType dtype, const ferry::Shape& shape,
                    ferry::TensorView* out);
  std::map<std::string, ferry::Buffer> buffers_;
  ferry::reload::Checkpoint views_;
};

}  // namespace tiny

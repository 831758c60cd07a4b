// The tiny decoder: embedding, RMSNorm, GQA attention with RoPE and a KV cache, SwiGLU MLP and
// lm_head, on ferry's quantized reference GEMMs (kernels/gemm.h). One decode step is captured once
// as a CapturedProgram whose launches bake the registered storage they read (taken from the
// reload engine's registry, never from a pointer of the decoder's own); greedy generation replays
// it token by token, the host writing only the token and position into program-owned memory.
// On a CUDA device the step is a real CUDA graph: kernels::gemm_async and the step kernels of
// step_kernels.h only enqueue on the capturing stream.
#pragma once

#include <memory>
#include <vector>

#include "examples/tiny_decoder/model.h"
#include "reload/captured_program.h"
#include "reload/registry.h"

namespace tiny {

class Decoder {
 public:
  // Captures the decode step over the registered tensors of `spec` found in `registry`, on
  // `device` (where the registry's storage lives): a CapturedProgram on the CPU, a CUDA graph on a
  // CUDA device.
  static ferry::Result<std::unique_ptr<Decoder>> create(const Config& cfg, const ferry::sharding::RankSpec& spec,
                                                        const ferry::reload::LayerRegistry& registry,
                                                        ferry::Device device = ferry::Device::cpu());

  // Greedy: feeds `prompt` from position 0, then generates `new_tokens` tokens.
  ferry::Result<std::vector<int32_t>> generate(const std::vector<int32_t>& prompt, int new_tokens);
  // generate(), returned as bytes together with the logits of the last step (for bitwise
  // comparisons and the flip probe).
  ferry::Result<std::vector<uint8_t>> outputs(const std::vector<int32_t>& prompt, int new_tokens);
  const std::vector<float>& last_logits() const { return logits_; }
  // One decode step: feeds `token` at position `pos` (the KV cache holds positions < pos) and
  // returns the greedy next token. Generation can stop between steps and continue later, on
  // whatever weights the storage holds then.
  ferry::Result<int32_t> step(int32_t token, int32_t pos);

  ferry::reload::CapturedProgram& program() { return *program_; }

 private:
  Decoder(Config cfg, ferry::Device device) : cfg_(cfg), device_(device) {}
  ferry::Status capture(const ferry::sharding::RankSpec& spec, const ferry::reload::LayerRegistry& registry);

  struct Check {
    ferry::Scheme scheme;
    std::vector<ferry::TensorView> weight;
  };

  Config cfg_;
  ferry::Device device_;
  int64_t vpad_ = 0;
  std::vector<Check> checks_;  // GEMMs whose workspace reports a failure (gptq_int4)
  std::unique_ptr<ferry::reload::CapturedProgram> program_;
  ferry::TensorView token_, pos_, next_, logits_view_;
  std::vector<float> logits_;
};

}  // namespace tiny

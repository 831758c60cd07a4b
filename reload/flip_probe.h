// The flip probe: proof that a captured program reads the live storage the engine writes. After a
// reload, write a legal but wrong value into live registered tensors (reverse a permutation, whose
// entries stay in range; negate a derived scale) and replay: the outputs must change. On code that
// lost a tensor's identity the program reads the old memory and the flip changes nothing. The
// probe restores the original values before it returns.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reload/registry.h"

namespace ferry::reload {

struct FlipReport {
  std::vector<std::string> flipped;
  bool changed = false;  // the outputs after the flip differ from before
  std::string to_string() const;  // "flip: 4 tensors flipped, outputs changed"
};

// Registered runtime permutations (i32 vectors named "*.perm").
std::vector<std::string> permutation_tensors(const LayerRegistry& registry);
// Registered f32 or f16 scales (names ending in "scale" or "scales").
std::vector<std::string> scale_tensors(const LayerRegistry& registry);

// Runs `run` (replay, then the outputs as bytes), flips `targets` in place, runs it again,
// restores them. Permutations are reversed; f32/f16 scales are negated. Host or device storage.
Result<FlipReport> flip_probe(const LayerRegistry& registry, const std::vector<std::string>& targets,
                              const std::function<Result<std::vector<uint8_t>>()>& run);

}  // namespace ferry::reload

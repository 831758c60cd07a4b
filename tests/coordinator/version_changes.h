// How the delta tests change a checkpoint from one version to the next: a fraction of elements by
// one unit in the last place (what a step at a small learning rate does to most changed bf16
// weights), an amax that moves, or every element.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>

#include "tests/coordinator/cluster.h"

namespace ferry::testutil {

// Changes `fraction` of every tensor's elements, each by one unit in the last place.
inline void nudge(Checkpoint& ck, double fraction, std::mt19937_64& rng) {
  for (auto& [name, v] : ck.data) {
    const size_t k = static_cast<size_t>(fraction * static_cast<double>(v.size()));
    for (size_t i = 0; i < k; ++i) v[rng() % v.size()] ^= 1;
  }
}

// One element of every matrix far above the rest: every scale whose group holds it moves.
inline void move_amax(Checkpoint& ck, std::mt19937_64& rng) {
  for (auto& [name, v] : ck.data) {
    if (v.size() > 1000) v[rng() % v.size()] = 0x4248;  // 50.0 in bf16
  }
}

// Every element changes.
inline void renew(Checkpoint& ck, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 0.1f);
  for (auto& [name, v] : ck.data) {
    for (auto& b : v) {
      const float f = dist(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t old = b;
      b = static_cast<uint16_t>(u >> 16);
      if (b == old) b ^= 1;
    }
  }
}

}  // namespace ferry::testutil

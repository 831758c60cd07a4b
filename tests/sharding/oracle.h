// Test-side, independent statement of where every source element must land on every rank, and an
// independent reassembly of a plan's pieces. Written from the layouts' definitions (vLLM's TP
// sharding), not from sharding/ code.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "sharding/model_config.h"
#include "sharding/planner.h"

namespace ferry::sharding::testing {

struct TCfg {
  int64_t h = 16, nh = 4, kv = 2, hd = 4, inter = 8, vocab = 50, layers = 2;
  bool tie = false, bias = false, qk_norm = false;
  int64_t experts = 0, mi = 0, sparse_step = 1;
  bool mixtral = false;
  bool stacked = false;  // the trainer holds each layer's experts stacked (sharding::stack_experts)
  int tp = 1, ep = 1;
  int64_t pad = 1;
  int replicas = 1;

  std::string describe() const;
  ModelConfig model_config() const;
  bool layer_is_moe(int64_t i) const { return experts > 0 && (sparse_step <= 1 || (i + 1) % sparse_step == 0); }
};

// A random configuration: TP 1..8, KV heads below and above TP, vocabularies that do not divide,
// optional tied embeddings, qkv bias, q/k norm, and experts under EP.
TCfg random_cfg(std::mt19937_64& rng, bool moe);

struct Place {
  int rank = 0;  // replica * tp + tp rank
  std::string param;
  int64_t flat = 0;  // row-major index in the rank's parameter
};

// Every place element `flat` of source `name` (of `shape`) must reach.
void expected_places(const TCfg& c, const std::string& name, const Shape& shape, int64_t flat, std::vector<Place>* out);

// Element value of the test's source tensors: unique per (source, element).
inline uint64_t source_value(int source, int64_t flat) { return (static_cast<uint64_t>(source + 1) << 36) | static_cast<uint64_t>(flat); }

struct Reassembled {
  // [rank][param] element values and write counts.
  std::vector<std::vector<std::vector<uint64_t>>> values;
  std::vector<std::vector<std::vector<int>>> writes;
  std::string error;  // first structural problem, empty when none
};

// Copies every piece of `plan` from the synthetic sources into per-rank parameter buffers.
Reassembled reassemble(const Manifest& manifest, const std::vector<RankSpec>& ranks, const Plan& plan);

// Checks `r` against expected_places(): every expected element equal and written once, nothing
// else written. Returns the first mismatch, or "".
std::string check_against_oracle(const TCfg& c, const Manifest& manifest, const std::vector<RankSpec>& ranks,
                                 const Reassembled& r);

}  // namespace ferry::sharding::testing

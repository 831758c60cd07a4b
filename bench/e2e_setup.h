// What `ferry bench e2e` sets up around its measurements: the model its ranks hold, that model's
// weights of each version, the replica's rank processes, and the median it reports.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "bench/e2e_probe.h"
#include "core/status.h"
#include "core/tensor.h"
#include "sharding/llama.h"
#include "sharding/planner.h"

namespace ferry::e2e {

// Full-precision weights of one version: every tensor differs from the previous version's.
struct Weights {
  std::vector<std::vector<uint16_t>> data;  // manifest order
  std::vector<TensorView> views;
  std::map<std::string, TensorView> by_name;

  Weights(const sharding::Manifest& m, uint64_t version);
};

// New bf16 values in about [-0.06, 0.06] (each seed its own), made on the work pool.
void fill_bf16(std::span<uint16_t> out, uint64_t seed);

// The middle value (the upper of the two of an even count); 0 when empty.
double median(std::vector<double> v);

// The demo model's rank specs of a TP replica under `scheme` (an online scheme's name).
Result<std::vector<sharding::RankSpec>> demo_rank_specs(const sharding::LlamaConfig& cfg, int tp,
                                                        const std::string& scheme);

// The model a bench's ranks hold: "demo" (the demo model), or "delta" (a Llama of 117M parameters,
// large enough that per-element changes between steps, not round trips, decide an update's time).
Result<sharding::LlamaConfig> model_config(const std::string& model);

// Starts the replica's `tp` rank processes (`ferry bench e2e-rank`, into `children`), joining
// `coordinator` over `transport`, and returns their probe connections in rank order.
Result<std::vector<ProbeSocket>> start_ranks(ProbeListener& listener, std::vector<Child>& children,
                                             const std::string& coordinator, int tp, const std::string& scheme,
                                             const std::string& transport, int64_t timeout_ms,
                                             const std::string& model = "demo");

}  // namespace ferry::e2e

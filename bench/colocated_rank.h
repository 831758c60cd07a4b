// The rollout side of ferry-bench-colocated: the model (Llama-3-8B's shape, a preset such as
// qwen3-30b-a3b, or a config.json), the rank spec of one TP rank under "SCHEME" or "SCHEME@LAYOUT"
// (--scheme with --layout), and the rollout role's process.
#pragma once

#include <string>

#include "core/status.h"
#include "sharding/layout.h"

namespace ferry::bench {

// Which model the bench updates: `model` names a preset (`ferry plan --model`) or a config.json or
// mapping file; empty: Llama-3-8B's shape with `layers` decoder layers. Its routed experts are one
// tensor per expert, or stacked per layer.
struct BenchModel {
  std::string model;
  int layers = 32;
  bool stacked_experts = false;  // the trainer holds each layer's experts stacked (sharding::stack_experts)
};

Result<sharding::ModelDesc> bench_model(const BenchModel& m);

// Rank `tp_rank` of a TP `tp` replica of `model`, its linear layers under `scheme`: "SCHEME" or
// "SCHEME@LAYOUT" (an engine layout, docs/engines.md).
Result<sharding::RankSpec> colocated_rank_spec(const sharding::ModelDesc& model, const std::string& scheme,
                                               int tp_rank, int tp);

// What a rollout rank counted over the job, written to `report_path` when it ends: the versions
// it took, the quantize kernel runs (kernels::quantize_runs()) they made, and the trainer allocations
// it mapped for direct reads.
struct RankCounts {
  uint64_t versions = 0;
  uint64_t quantize_runs = 0;
  uint64_t mapped = 0;         // the trainer's allocations mapped (transport::ipc_stats())
  double map_seconds = 0;      // and the time that took
};
Result<RankCounts> read_rank_counts(const std::string& report_path);

// The rollout role: that rank's storage on cuda:`device`, served until the coordinator ends the
// job; its counts then go to `report_path` (when not empty). The process exit status.
int run_colocated_rank(const std::string& coordinator, const BenchModel& model, const std::string& scheme,
                       int tp_rank, int tp, int device, const std::string& report_path);

}  // namespace ferry::bench

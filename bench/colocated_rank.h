// The rollout side of ferry-bench-colocated: the Llama-3-8B shaped model, the rank spec of one TP
// rank under "SCHEME" or "SCHEME@LAYOUT" (--scheme with --layout), and the rollout role's process.
#pragma once

#include <string>

#include "core/status.h"
#include "sharding/llama.h"

namespace ferry::bench {

// Llama-3-8B's shape with `layers` decoder layers.
sharding::LlamaConfig llama3_8b(int layers);

// Rank `tp_rank` of a TP `tp` replica of llama3_8b(layers), its linear layers under `scheme`:
// "SCHEME" or "SCHEME@LAYOUT" (an engine layout, docs/engines.md).
Result<sharding::RankSpec> colocated_rank_spec(const std::string& scheme, int layers, int tp_rank, int tp);

// The rollout role: that rank's storage on cuda:`device`, served until the coordinator ends the
// job. The process exit status.
int run_colocated_rank(const std::string& coordinator, const std::string& scheme, int layers, int tp_rank, int tp,
                       int device);

}  // namespace ferry::bench

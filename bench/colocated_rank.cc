#include "bench/colocated_rank.h"

#include <iostream>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "coordinator/rollout_worker.h"
#include "reload/model_storage.h"

namespace ferry::bench {

sharding::LlamaConfig llama3_8b(int layers) {
  sharding::LlamaConfig c;
  c.hidden_size = 4096;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.intermediate_size = 14336;
  c.vocab_size = 128256;
  c.num_layers = layers;
  c.tie_word_embeddings = false;
  return c;
}

Result<sharding::RankSpec> colocated_rank_spec(const std::string& scheme, int layers, int tp_rank, int tp) {
  const size_t at = scheme.find('@');
  FERRY_ASSIGN_OR_RETURN(const Scheme linear, parse_scheme(scheme.substr(0, at)));
  FERRY_ASSIGN_OR_RETURN(sharding::RankSpec spec, sharding::llama_rank_spec(llama3_8b(layers), tp_rank, tp, linear));
  if (at != std::string::npos) {
    FERRY_ASSIGN_OR_RETURN(spec.layout, parse_engine_layout(scheme.substr(at + 1)));
  }
  return spec;
}

int run_colocated_rank(const std::string& coordinator, const std::string& scheme, int layers, int tp_rank, int tp,
                       int device) {
  set_log_identity(fmt::format("rank {}", tp_rank));
  auto spec = colocated_rank_spec(scheme, layers, tp_rank, tp);
  if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
  // Device transports (nccl, cuda_ipc) move memory of the current device: the storage's.
  if (auto st = set_current_device(Device::cuda(device)); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  auto storage = reload::ModelStorage::allocate(*spec, Device::cuda(device));
  if (!storage.ok()) return std::cerr << storage.status().to_string() << "\n", 1;
  coordinator::RolloutOptions o;
  o.coordinator = coordinator;
  o.spec = *spec;
  o.storage = &*storage;
  auto worker = coordinator::RolloutWorker::create(std::move(o));
  if (!worker.ok()) return std::cerr << worker.status().to_string() << "\n", 1;
  Status end;
  while ((end = (*worker)->wait_closed(60'000)).code() == StatusCode::kDeadlineExceeded) {
  }
  if (!end.ok()) return std::cerr << end.to_string() << "\n", 4;
  return 0;
}

}  // namespace ferry::bench

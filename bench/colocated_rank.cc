#include "bench/colocated_rank.h"

#include <fstream>
#include <iostream>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "coordinator/rollout_worker.h"
#include "kernels/quantize.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"
#include "sharding/presets.h"
#include "transport/ipc_share.h"

namespace ferry::bench {

Result<sharding::ModelDesc> bench_model(const BenchModel& m) {
  if (m.model.empty()) {
    sharding::LlamaConfig c;  // Llama-3-8B
    c.hidden_size = 4096;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.intermediate_size = 14336;
    c.vocab_size = 128256;
    c.num_layers = m.layers;
    c.tie_word_embeddings = false;
    return sharding::describe_model(c);
  }
  auto desc = sharding::preset_model(m.model);
  if (!desc.ok() && (m.model.find('/') != std::string::npos || m.model.find(".json") != std::string::npos)) {
    desc = sharding::model_from_file(m.model);
  }
  if (desc.ok() && m.stacked_experts) FERRY_RETURN_IF_ERROR(sharding::stack_experts(*desc));
  return desc;
}

Result<sharding::RankSpec> colocated_rank_spec(const sharding::ModelDesc& model, const std::string& scheme,
                                               int tp_rank, int tp) {
  const size_t at = scheme.find('@');
  FERRY_ASSIGN_OR_RETURN(const Scheme linear, parse_scheme(scheme.substr(0, at)));
  FERRY_ASSIGN_OR_RETURN(sharding::RankSpec spec, sharding::model_rank_spec(model, tp_rank, tp, /*ep_size=*/1, linear));
  if (at != std::string::npos) {
    FERRY_ASSIGN_OR_RETURN(spec.layout, parse_engine_layout(scheme.substr(at + 1)));
  }
  return spec;
}

Result<RankCounts> read_rank_counts(const std::string& report_path) {
  std::ifstream in(report_path);
  RankCounts c;
  if (!(in >> c.versions >> c.quantize_runs >> c.mapped >> c.map_seconds)) {
    return Status::not_found(fmt::format("rank report {}: missing or unreadable", report_path));
  }
  return c;
}

int run_colocated_rank(const std::string& coordinator, const BenchModel& model, const std::string& scheme,
                       int tp_rank, int tp, int device, const std::string& report_path) {
  set_log_identity(fmt::format("rank {}", tp_rank));
  auto desc = bench_model(model);
  if (!desc.ok()) return std::cerr << desc.status().to_string() << "\n", 1;
  auto spec = colocated_rank_spec(*desc, scheme, tp_rank, tp);
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
  if (!report_path.empty()) {
    const auto ipc = transport::ipc_stats();
    std::ofstream(report_path) << (*worker)->weight_version() << " " << kernels::quantize_runs() << " " << ipc.mapped
                               << " " << ipc.map_seconds << "\n";
  }
  if (!end.ok()) return std::cerr << end.to_string() << "\n", 4;
  return 0;
}

}  // namespace ferry::bench

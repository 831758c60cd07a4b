// One weight update of a tiny Llama, trainer and a TP-1 rank in this process, through the installed
// headers and libraries only: the program tests/packaging builds with CMake and with pkg-config.
#include <cstdio>
#include <map>
#include <vector>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "core/version.h"
#include "sharding/llama.h"

namespace {

ferry::Status run() {
  using namespace ferry;
  sharding::LlamaConfig cfg;
  cfg.hidden_size = 64;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  cfg.intermediate_size = 128;
  cfg.vocab_size = 100;
  cfg.num_layers = 1;
  FERRY_ASSIGN_OR_RETURN(auto trainer, coordinator::Trainer::create({}));
  FERRY_ASSIGN_OR_RETURN(auto spec, sharding::llama_rank_spec(cfg, 0, 1, Scheme::kFp8PerTensor));
  FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cpu()));
  coordinator::RolloutOptions o;
  o.coordinator = trainer->coordinator_address();
  o.spec = spec;
  o.storage = &storage;
  o.pause = [](const coordinator::PauseRequest&) { return ok_status(); };
  o.resume = [](uint64_t) { return ok_status(); };
  FERRY_ASSIGN_OR_RETURN(auto worker, coordinator::RolloutWorker::create(std::move(o)));
  FERRY_RETURN_IF_ERROR(trainer->wait_for_ranks(1, 10'000));

  const sharding::Manifest manifest = sharding::llama_manifest(cfg);
  std::map<std::string, std::vector<uint16_t>> weights;
  std::map<std::string, TensorView> views;
  for (const auto& t : manifest) {
    auto& w = weights[t.name];
    w.assign(static_cast<size_t>(shape_numel(t.shape)), 0x3f80);  // bf16 1.0
    views.emplace(t.name, TensorView(w.data(), DType::kBF16, t.shape));
  }
  FERRY_RETURN_IF_ERROR(trainer->start_weight_update(1, manifest));
  coordinator::MapSource source(views);
  FERRY_RETURN_IF_ERROR(trainer->update_weights(source));
  FERRY_ASSIGN_OR_RETURN(auto report, trainer->finish_weight_update());
  if (report.version != 1 || worker->weight_version() != 1 || report.moved != 0) {
    return Status::internal("the update did not land whole");
  }
  std::printf("ferry %s: update v1 ok bytes=%llu moved=%llu/%llu\n", kVersion,
              static_cast<unsigned long long>(report.bytes), static_cast<unsigned long long>(report.moved),
              static_cast<unsigned long long>(report.registered));
  return ok_status();
}

}  // namespace

int main() {
  ferry::Status st = run();
  if (!st.ok()) std::fprintf(stderr, "%s\n", st.to_string().c_str());
  return st.ok() ? 0 : 1;
}

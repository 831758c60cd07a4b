// An in-process cluster for coordinator tests: a trainer with the embedded coordinator and the TP
// ranks of one replica (or several) as RolloutWorkers, all over real sockets on 127.0.0.1.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cstring>

#include <xxhash.h>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"

namespace ferry::testutil {

inline sharding::LlamaConfig llama_config(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t intermediate,
                                          int64_t vocab, int64_t layers) {
  sharding::LlamaConfig c;
  c.hidden_size = hidden;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = intermediate;
  c.vocab_size = vocab;
  c.num_layers = layers;
  return c;
}

inline sharding::LlamaConfig tiny_llama() { return llama_config(128, 4, 2, 256, 300, 2); }

// One layer behind an embedding (and lm_head) of 36,000 x 1,024 bf16: 70 MiB each, larger than
// any bucket a default receiver would take without being told.
inline sharding::LlamaConfig wide_llama() { return llama_config(1024, 8, 8, 1024, 36000, 1); }

// Full-precision checkpoint tensors for a manifest, seeded.
struct Checkpoint {
  std::map<std::string, std::vector<uint16_t>> data;
  std::map<std::string, TensorView> views;

  Checkpoint(const sharding::Manifest& m, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.0f, 0.1f);
    for (const auto& t : m) {
      auto& v = data[t.name];
      v.resize(static_cast<size_t>(shape_numel(t.shape)));
      for (auto& b : v) {
        const float f = dist(rng);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        b = static_cast<uint16_t>(u >> 16);
      }
      views.emplace(t.name, TensorView(v.data(), DType::kBF16, t.shape));
    }
  }
};

struct Rank {
  std::unique_ptr<reload::ModelStorage> storage;
  std::unique_ptr<coordinator::RolloutWorker> worker;
  std::atomic<int> pauses{0};
  std::atomic<int> resumes{0};
  std::atomic<uint64_t> last_resume{0};
  std::atomic<bool> fail_resume{false};  // the resume hook fails while set

  // XXH3 over every storage tensor's bytes: changes if any byte of storage changes.
  uint64_t fingerprint() const {
    uint64_t h = 0;
    for (const auto& [name, v] : storage->tensors()) h = XXH3_64bits_withSeed(v.data(), v.nbytes(), h);
    return h;
  }
};

class Cluster {
 public:
  // `replicas` replicas of `tp` ranks each: rank r is TP rank r % tp of replica r / tp.
  explicit Cluster(int tp, std::string scheme = "fp8_per_tensor", sharding::LlamaConfig cfg = tiny_llama(),
                   int replicas = 1)
      : cfg_(cfg), tp_(tp), replicas_(replicas), scheme_(std::move(scheme)) {}

  Status start(const coordinator::TrainerOptions& options = {}) {
    FERRY_ASSIGN_OR_RETURN(trainer_, coordinator::Trainer::create(options));
    for (int r = 0; r < tp_ * replicas_; ++r) FERRY_RETURN_IF_ERROR(add_rank(r));
    return trainer_->wait_for_ranks(tp_ * replicas_, 10'000);
  }

  // The replica's ranks alone, joining the coordinator at `address` (a standalone one, or the
  // trainer ranks' own): the test's trainers run elsewhere.
  Status start_ranks(const std::string& address) {
    address_ = address;
    for (int r = 0; r < tp_; ++r) FERRY_RETURN_IF_ERROR(add_rank(r));
    return ok_status();
  }

  Status add_rank(int r) {
    FERRY_ASSIGN_OR_RETURN(auto rank, make_rank(r));
    ranks_.push_back(std::move(rank));
    return ok_status();
  }

  // Rank `r` restarts: its process ends (the worker and its storage go) and a new one joins in its
  // place, holding nothing of any version.
  Status restart_rank(int r) {
    ranks_[static_cast<size_t>(r)].reset();
    FERRY_ASSIGN_OR_RETURN(ranks_[static_cast<size_t>(r)], make_rank(r));
    return ok_status();
  }

  Result<std::unique_ptr<Rank>> make_rank(int r) {
    auto rank = std::make_unique<Rank>();
    FERRY_ASSIGN_OR_RETURN(const Scheme scheme, parse_scheme(scheme_));
    FERRY_ASSIGN_OR_RETURN(auto spec, sharding::llama_rank_spec(cfg_, r % tp_, tp_, scheme));
    spec.replica = r / tp_;
    FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cpu()));
    rank->storage = std::make_unique<reload::ModelStorage>(std::move(storage));
    coordinator::RolloutOptions o;
    o.coordinator = trainer_ ? trainer_->coordinator_address() : address_;
    o.spec = spec;
    o.storage = rank->storage.get();
    Rank* raw = rank.get();
    o.pause = [raw](const coordinator::PauseRequest&) {
      raw->pauses++;
      return ok_status();
    };
    o.resume = [raw](uint64_t v) {
      raw->resumes++;
      if (raw->fail_resume) return Status::internal("the engine could not restart its scheduler");
      raw->last_resume = v;
      return ok_status();
    };
    FERRY_ASSIGN_OR_RETURN(rank->worker, coordinator::RolloutWorker::create(std::move(o)));
    return rank;
  }

  sharding::Manifest manifest() const { return sharding::llama_manifest(cfg_); }

  Result<coordinator::UpdateReport> update(uint64_t version, const Checkpoint& ck) {
    FERRY_RETURN_IF_ERROR(trainer_->start_weight_update(version, manifest()));
    coordinator::MapSource src(ck.views);
    FERRY_RETURN_IF_ERROR(trainer_->update_weights(src));
    return trainer_->finish_weight_update();
  }

  coordinator::Trainer& trainer() { return *trainer_; }
  Rank& rank(int r) { return *ranks_[static_cast<size_t>(r)]; }
  int tp() const { return tp_; }

 private:
  sharding::LlamaConfig cfg_;
  int tp_;
  int replicas_ = 1;
  std::string scheme_;
  std::unique_ptr<coordinator::Trainer> trainer_;
  std::string address_;  // the coordinator, without a trainer of the cluster's own
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace ferry::testutil

// One replica of a model updated in one process over real sockets (a trainer embedding the
// coordinator, the ranks' workers and storage), with random trainer weights exact in bf16 and a check
// that every element lands where the rank specs place it. Shared by the model-family update tests.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "reload/model_storage.h"
#include "sharding/presets.h"

namespace ferry::sharding::fixture {

// A config.json's text with `changes` merged in (RFC 7386: a null removes the key).
std::string with_changes(std::string_view config, const nlohmann::json& changes);
// The manifest entry or rank parameter of that name, or nullptr.
const SourceTensor* find_source(const Manifest& m, const std::string& name);
const ParamSpec* find_param(const RankSpec& r, const std::string& name);

// Element i of a bf16 or f32 tensor, as a float.
float element(const TensorView& t, int64_t i);
// Row-major index in `shape` of the k-th element of the box `r`.
int64_t box_index(const Shape& shape, const Region& r, int64_t k);

// A tensor per manifest entry, random values exact in bf16 (so f32 sources stored as bf16 keep them).
struct Weights {
  std::map<std::string, std::vector<char>> bytes;
  std::map<std::string, TensorView> views;

  explicit Weights(const Manifest& m, uint32_t seed = 7);
};

struct Replica {
  std::unique_ptr<coordinator::Trainer> trainer;
  std::vector<RankSpec> specs;
  std::vector<std::unique_ptr<reload::ModelStorage>> storage;
  std::vector<std::unique_ptr<coordinator::RolloutWorker>> workers;

  Status start(const ModelDesc& model, int tp, int ep, Scheme scheme, EngineLayout layout = EngineLayout::kFerry);
  Result<coordinator::UpdateReport> update(uint64_t version, const Manifest& manifest, const Weights& w);
};

// Every element every slice of every rank places, compared with the trainer's; the first
// difference, or "".
std::string check_storage(const Replica& r, const Weights& w);

}  // namespace ferry::sharding::fixture

// The layerwise reload engine of one rank: registry of every tensor its kernels read, per-layer
// staging in checkpoint format, exact coverage, processing into registered storage as soon as a
// layer is complete, and the census that proves no registered tensor moved.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "reload/coverage.h"
#include "reload/model_storage.h"
#include "sharding/model_spec.h"

namespace ferry::reload {

struct Identity {
  const void* data = nullptr;
  size_t bytes = 0;
  bool operator==(const Identity&) const = default;
};

struct Census {
  uint64_t moved = 0;
  uint64_t registered = 0;
  std::vector<std::string> moved_names;
  std::string to_string() const;  // "moved=0/42"
};

struct EngineReport {
  uint64_t version = 0;
  uint64_t bytes = 0;          // piece bytes received
  uint64_t pieces = 0;
  uint64_t layers = 0;         // layers processed
  uint64_t peak_staging_bytes = 0;
  double process_seconds = 0;  // time in processing kernels
  Census census;
};

class ReloadEngine {
 public:
  // Registers every storage tensor of every parameter of `spec`; `storage` must outlive the engine.
  static Result<std::unique_ptr<ReloadEngine>> create(sharding::RankSpec spec, ModelStorage& storage);

  // Starts update `version`: clears coverage and staging.
  Status begin(uint64_t version);
  // Writes one piece (`bytes` packed elements of `dtype`) at `dst` inside parameter `param`.
  // Processes the parameter's layer when it becomes complete.
  Status apply_piece(uint32_t param, const Region& dst, DType dtype, const void* data, size_t bytes);
  // Ends the update: every layer complete, census moved 0/N; otherwise an error naming what is
  // missing or moved. Incomplete layers keep their previous storage untouched.
  Result<EngineReport> finalize();
  // Drops staging; storage keeps whatever layers were already processed.
  void abort();

  Census census() const;
  const sharding::RankSpec& spec() const { return spec_; }
  uint64_t version() const { return version_; }
  bool in_update() const { return in_update_; }
  size_t layer_count() const { return layers_.size(); }

 private:
  struct Layer {
    std::string name;
    std::vector<uint32_t> params;
    std::map<uint32_t, Buffer> staging;
    uint64_t staging_bytes = 0;
    bool processed = false;
  };
  struct Param {
    uint32_t layer = 0;
    Coverage coverage;
    std::vector<std::string> storage;  // storage names in layout order
    bool padded = false;               // slices leave elements uncovered: staging starts zeroed
  };

  ReloadEngine(sharding::RankSpec spec, ModelStorage& storage) : spec_(std::move(spec)), storage_(storage) {}
  Status init();
  Status stage(Layer& layer, uint32_t param);
  Status process(Layer& layer);
  void release(Layer& layer);

  sharding::RankSpec spec_;
  ModelStorage& storage_;
  std::vector<Param> params_;
  std::vector<Layer> layers_;
  std::map<std::string, Identity> registered_;
  uint64_t version_ = 0;
  bool in_update_ = false;
  uint64_t max_staging_ = 0;
  uint64_t staging_bytes_ = 0;
  bool warned_out_of_order_ = false;
  EngineReport report_;
};

}  // namespace ferry::reload

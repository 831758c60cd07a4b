// The rollout side of ferry: a rank registers its model spec and live storage, and serves weight
// updates on background threads. The engine's pause and resume hooks run around every update.
//
//   RolloutOptions o;
//   o.spec = ferry::sharding::llama_rank_spec(cfg, tp_rank, tp_size, ferry::Scheme::kFp8PerTensor).value();
//   o.storage = &storage;                 // the tensors the model's kernels read
//   o.pause = [&](const PauseRequest& r) { engine.pause(r.mode); return ferry::ok_status(); };
//   o.resume = [&](uint64_t v) { engine.resume(); return ferry::ok_status(); };
//   auto worker = RolloutWorker::create(std::move(o)).value();   // joins the coordinator
//   ... generate, tagging samples with worker->weight_version() ...
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/status.h"
#include "reload/model_storage.h"
#include "sharding/model_spec.h"

namespace ferry::coordinator {

struct PauseRequest {
  uint64_t version = 0;  // the version about to be loaded
  std::string mode;      // abort: cancel in-flight generation; wait: drain it; keep: freeze it in place
  bool clear_cache = true;  // whether cached state (KV cache, prefix cache) must be dropped
};

struct RolloutOptions {
  std::string coordinator;  // host:port; empty: settings' coordinator (FERRY_COORDINATOR)
  sharding::RankSpec spec;
  reload::ModelStorage* storage = nullptr;
  // Runs before any byte of the update is written; generation must not read weights until resume.
  std::function<Status(const PauseRequest&)> pause;
  // Runs once every rank of the replica holds `version` complete.
  std::function<Status(uint64_t version)> resume;
  // Every FERRY_* value this rank uses (timeout, verify, transports, staging bound, rollback, ...).
  // Unset: load_settings(), the environment; Python's ferry.RolloutWorker(**settings) passes
  // keywords over it.
  std::optional<Settings> settings;
};

// A data transport a rank listens on, and the blob a sender connects with.
struct DataEndpoint {
  std::string transport;
  std::string blob;
};

class RolloutWorker {
 public:
  // Joins the coordinator and starts serving updates on background threads.
  static Result<std::unique_ptr<RolloutWorker>> create(RolloutOptions options);
  virtual ~RolloutWorker() = default;

  // The version the rank's storage holds; every generated sample can carry it.
  virtual uint64_t weight_version() const = 0;
  // False from the moment an update starts rewriting storage until a complete version lands; an
  // aborted update leaves it false (the rank stays paused) until the next complete update.
  virtual bool consistent() const = 0;
  // True from a pause until the resume, and before the first version lands. Requests that arrive
  // while paused should wait: wait_serving() blocks until the rank serves again.
  virtual bool paused() const = 0;
  virtual Status wait_serving(int64_t timeout_ms) = 0;
  // Blocks until the connection to the coordinator ends, or `timeout_ms` passes (DeadlineExceeded).
  // Then: OK when the coordinator ended the job; Unavailable when it was lost (killed, network),
  // with the state it left this rank in (paused on an incomplete version, or serving one).
  virtual Status wait_closed(int64_t timeout_ms) = 0;
  // Runs the resume hook again after it failed at the end of an update (the rank stays paused, its
  // replica not serving, until this or a later update succeeds) and tells the coordinator.
  virtual Status resume() = 0;
  // Where this rank takes buckets, in its preference order (what the coordinator hands senders).
  virtual std::vector<DataEndpoint> data_endpoints() const = 0;
};

}  // namespace ferry::coordinator

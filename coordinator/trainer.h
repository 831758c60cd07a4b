// The trainer side of ferry: start_weight_update / send / finish_weight_update.
//
//   auto trainer = ferry::coordinator::Trainer::create({}).value();   // embeds the coordinator
//   trainer->start_weight_update(step, manifest);                     // pauses every replica
//   for (auto& [name, t] : weights) trainer->send(name, t);          // or update_weights(source)
//   auto report = trainer->finish_weight_update();                   // resumes them at `step`
//
// Contract: the trainer does not modify its weights between start_weight_update() and
// finish_weight_update() returning. Host tensors are read during send(); device tensors going to a
// rank on this node whose storage is on a GPU (FERRY_DIRECT=auto, the default) are read in place
// by that rank's kernels until finish_weight_update() returns: each device allocation holding
// them is exported once by CUDA IPC (one handle per allocation, not per tensor or update), the
// first send() of an update waits for the work this process queued on the device, and the rank
// quantizes straight from the trainer's memory into its storage (2 bytes read and 1 written per
// bf16 parameter in fp8). Weights from cudaMalloc can be read so (PyTorch's caching allocator's
// are); memory without a legacy IPC handle (stream-ordered pools, expandable segments) is sent as
// bytes, with a warning. Other device pieces are copied to host and sent as bytes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/tensor.h"
#include "sharding/model_spec.h"
#include "sharding/planner.h"
#include "sharding/source_layout.h"

namespace ferry::coordinator {

struct TrainerOptions {
  std::string coordinator;  // host:port to join; empty: embed a coordinator in this process
  std::string listen_host;  // embedded coordinator's address; empty: settings' listen_host
  uint16_t port = 0;        // embedded coordinator's port; 0: any
  std::string pause_mode = "abort";  // abort, wait or keep
  bool clear_cache = true;           // told to the pause hook
  // Every FERRY_* value this trainer uses (and its embedded coordinator). Unset: load_settings(),
  // the environment; Python's ferry.Trainer(**settings) passes keywords over it.
  std::optional<Settings> settings;
  // A sharded trainer: this process is trainer rank `trainer_rank` of `trainer_ranks`, each joining
  // one coordinator (embedded in one of them, or `ferry coordinator`). Updates are collective over
  // the trainer ranks: start_weight_update returns once all of them have started it and their
  // holdings cover the manifest; finish_weight_update once every one has finished and every rollout
  // rank holds the complete version.
  int trainer_rank = 0;
  int trainer_ranks = 1;
};

// Per-update choices. `replicas` limits the update to some replicas (rolling updates: update one
// group while the others keep serving, then the next group at the same version); empty: all.
//
// `holdings`: what this trainer rank holds of the manifest (sharding/holdings.h): `owns` names
// tensors held whole, `holds` boxes of the global tensors (FSDP2's Shard(0) rows, a Megatron TP
// column block, a pipeline stage's layers); both empty means every tensor whole. send(name, t) and
// update_weights() then take, for a held box, the local tensor of the box's shape that backs it; the
// plan gives each trainer rank only pieces from its own memory, and no trainer rank ever needs a
// whole tensor it does not hold.
struct UpdateOptions {
  std::string pause_mode = "abort";
  bool clear_cache = true;
  std::vector<int> replicas;
  sharding::SenderInfo holdings;
  // Instead of `holdings`: where each held box lies in this rank's own tensors (Megatron's fused
  // linear_qkv / linear_fc1; sharding/source_layout.h). send() and update_weights() then take those
  // local tensors by their local names.
  sharding::SourceLayout source_layout;
  // Stage while serving (or FERRY_STAGE=on): the ranks receive the version into staging while they
  // serve the old one; each replica pauses only to apply it, once all its ranks hold every byte. A
  // rank whose FERRY_MAX_STAGING_BYTES cannot hold its input makes the update pause first (warned).
  bool stage = false;
};

// What one rank of an update was sent by this trainer, dense and as deltas (FERRY_DELTA).
struct RankDelta {
  uint64_t dense_bytes = 0;        // payload of pieces sent whole
  uint64_t delta_bytes = 0;        // payload of delta pieces: their encodings
  uint64_t delta_dense_bytes = 0;  // what those delta pieces would have carried whole
  uint64_t elements = 0;           // elements compared against the version the rank holds
  uint64_t changed = 0;            // of those, changed since
  // Bytes on the wire for the rank's pieces (not counting bucket headers or direct reads).
  uint64_t wire_bytes() const { return dense_bytes + delta_bytes; }
  double changed_fraction() const { return elements ? static_cast<double>(changed) / static_cast<double>(elements) : 0; }
};

struct UpdateReport {
  uint64_t version = 0;
  int ranks = 0;
  uint64_t bytes = 0;
  uint64_t direct_bytes = 0;  // of `bytes`, read in place from this trainer's device memory by colocated ranks
  std::vector<uint64_t> buckets;  // buckets this trainer posted to each rank of the update, in plan order
  std::vector<RankDelta> delta;   // per rank of the update, in plan order: dense and delta bytes
  uint64_t delta_copy_bytes =
      0;                      // memory (host, or device: FERRY_DELTA_COPY) this trainer keeps to compute deltas against
  uint64_t shadow_bytes = 0;  // memory the ranks keep as delta shadows, host or device (FERRY_DELTA_SHADOW), summed
  // Bytes this trainer compared against its copies: each part once, however many replicas take it
  // (their ranks' elements in `delta` count it again for each).
  uint64_t compared_bytes = 0;
  // This trainer's time comparing and encoding them (each part once; compared on a GPU, the copy of
  // the encoding into the bucket too), and keeping its copies of the tensors it sent for the next
  // update's compare: the work a delta update costs at the sending end.
  double compare_seconds = 0;
  double copy_seconds = 0;
  uint64_t wire_bytes() const {
    uint64_t b = 0;
    for (const auto& d : delta) b += d.wire_bytes();
    return b;
  }
  uint64_t moved = 0;
  uint64_t registered = 0;
  uint64_t peak_staging_bytes = 0;
  // Host staging and scratch the ranks allocated anew (pages faulted in), summed: after a first update,
  // 0 while updates keep their shape.
  uint64_t allocated_staging_bytes = 0;
  double seconds = 0;  // start_weight_update to finish_weight_update returning
  double pause_seconds = 0;        // start_weight_update until every rank paused, as the trainer sees it
  double ranks_pause_seconds = 0;  // of that, from the coordinator's pause request to the last rank's answer
  double plan_seconds = 0;
  double transfer_seconds = 0;
  double process_seconds = 0;
  double resume_seconds = 0;
  // The longest time a replica did not serve: from its pause (staged: its apply) to its resume.
  // Without staging that is nearly `seconds`; with it, the apply.
  double pause_window_seconds = 0;
  bool staged = false;  // the update staged while serving (false: it paused first)
  double apply_seconds = 0;  // staged: the longest apply of a replica (pause hook, storage writes, finalize)
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }
};

// Named tensors a trainer sends; update_weights() asks for them in plan order.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual Result<TensorView> get(const std::string& name) = 0;
};

class MapSource final : public WeightSource {
 public:
  explicit MapSource(std::map<std::string, TensorView> tensors) : tensors_(std::move(tensors)) {}
  Result<TensorView> get(const std::string& name) override;

 private:
  std::map<std::string, TensorView> tensors_;
};

class Trainer {
 public:
  static Result<std::unique_ptr<Trainer>> create(const TrainerOptions& options);
  virtual ~Trainer() = default;

  // host:port of the coordinator this trainer uses.
  virtual std::string coordinator_address() const = 0;
  // Waits until `n` rollout ranks have joined, the embedded coordinator or the one this trainer joined.
  virtual Status wait_for_ranks(int n, int64_t timeout_ms) = 0;

  // Checks `manifest` against every replica (any mismatch fails here, before a byte moves), pauses
  // them all, and plans the transfer.
  virtual Status start_weight_update(uint64_t version, const sharding::Manifest& manifest) = 0;
  virtual Status start_weight_update(uint64_t version, const sharding::Manifest& manifest,
                                     const UpdateOptions& options) = 0;
  // Sends one tensor of the manifest (for a held box, the local tensor backing it); any order.
  virtual Status send(const std::string& name, const TensorView& tensor) = 0;
  // Sends every tensor of the manifest this trainer rank holds, pulled from `source` in plan order.
  virtual Status update_weights(WeightSource& source) = 0;
  // Waits until every rank holds the complete version, resumes them together, and reports.
  virtual Result<UpdateReport> finish_weight_update() = 0;
  // Ends the open update without finishing it (after a failed send, say): the ranks stay paused and
  // inconsistent, or with FERRY_ROLLBACK=host restore their previous version and resume on it. OK
  // once the update is over; FailedPrecondition when none is open.
  virtual Status abort_weight_update(const std::string& reason) = 0;
};

}  // namespace ferry::coordinator

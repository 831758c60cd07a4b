// The layerwise reload engine of one rank: the layer registry of every tensor its kernels read,
// per-layer staging in checkpoint format, exact coverage, processing into registered storage as
// soon as a layer is complete, and the census that proves no registered tensor moved.
//
// Memory: pieces that a scheme can process on their own (whole rows for per-channel schemes and
// conversions, whole 128-row bands for fp8_block, whole shards for fp8_per_tensor) are quantized at
// once straight into the parameter's registered storage; everything else is staged in full
// precision until its parameter is complete. Staging buffers are kept between updates in a pool
// (reload/buffer_pool.h): on the host up to what updates held at their peak, at least the largest
// layer; on a device, the largest layer.
//
// Writing storage before its layer is complete is safe because nobody reads it meanwhile: an
// update pauses the rank first and leaves it inconsistent (not serving) until a complete update
// lands, and under rollback the layer's snapshot is taken before its first row is written, so an
// update that fails afterwards (a missing piece, a dead sender, a refused layer) is undone whole.
// It saves a scratch copy of the storage and its copy-in at completion: a rank fed by several
// trainer ranks, whose buckets each leave many layers incomplete, quantized three quarters of its
// rows into scratch and copied them in. An update staged while the rank serves (begin(..., stage))
// writes nothing before the apply: there rows go into a scratch copy of the storage instead, copied
// in at the apply.
//
// Pieces whose bytes are still there when their layer completes are processed at completion, in
// place: the piece that completes a layer (its bytes are valid during the call that processes the
// layer), pieces the caller lends with lend_piece() (kept until the layer is processed or the update
// ends), and pieces it borrows with borrow_piece() (kept until release_borrowed(): a transport's
// bucket during its callback, so that every layer the bucket completes is processed from it in
// place; rows of the layers it leaves incomplete are processed at release_borrowed(), together).
// Of a kept piece the kernel cannot take whole (a vocabulary shard ending inside a 128-row band),
// the run of rows it can take is processed the same way; only the rows around it are staged. A kept
// band of one matrix of a stacked parameter (an expert's gate rows in a fused w13, from a trainer
// holding a tensor per expert) is processed the same way, after whatever was staged for the rest of
// its matrix (ProcessingKernel::can_process_band).
//
// Rollback (EngineOptions::rollback, FERRY_ROLLBACK=host): before a layer's storage is first written,
// every registered tensor of the layer is copied to host memory. rollback() copies them back in
// place and ends the update; a complete update (finalize() succeeding) drops them. Snapshots
// outlive a failed update that was not rolled back, so they always hold the last complete version.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "reload/buffer_pool.h"
#include "reload/coverage.h"
#include "reload/host_snapshots.h"
#include "reload/model_storage.h"
#include "reload/processing.h"
#include "reload/registry.h"
#include "sharding/model_spec.h"

namespace ferry::reload {

enum class RollbackMode : uint8_t { kOff, kHost };

struct EngineOptions {
  KernelFactory kernel_factory;  // empty: scheme_kernel()
  DType none_dtype = DType::kBF16;
  kernels::Exec exec;
  // CUDA storage and no `exec.stream`: complete layers are processed on this many streams of the
  // engine's own, one layer to each in turn (1: the legacy default stream, as before).
  int process_streams = 4;
  // A rank's RolloutWorker sets it from FERRY_ROLLBACK (off|host).
  RollbackMode rollback = RollbackMode::kOff;
  // Bound on out-of-order staging (FERRY_MAX_STAGING_BYTES at a rank), host and device staging
  // together; 0: none beyond one layer.
  uint64_t max_staging_bytes = 0;
  // Keep a full-precision copy of every input (the shadow), so that delta pieces apply on top of the
  // version it holds (FERRY_DELTA_SHADOW=host|device at a rank).
  bool delta_shadow = false;
  // The shadow in the storage's device memory (FERRY_DELTA_SHADOW=device; device storage only): a
  // delta's changed elements are written there by a kernel, and its parameters are processed from
  // it in place, so the host holds no copy and only the changes cross to the device.
  bool shadow_on_device = false;
};

struct EngineReport {
  uint64_t version = 0;
  uint64_t bytes = 0;  // piece bytes received
  uint64_t pieces = 0;
  uint64_t piecewise_pieces = 0;  // processed on arrival, without full-precision staging
  uint64_t direct_pieces = 0;     // processed at completion straight into storage (no scratch)
  uint64_t device_staged_pieces = 0;  // device pieces that had to be staged through host memory
  uint64_t staged_on_device_pieces = 0;  // device pieces staged on the device (no kernel takes them alone)
  uint64_t snapshot_bytes = 0;    // host snapshot held for rollback at the end of the update
  uint64_t layers = 0;            // layers processed
  uint64_t peak_staging_bytes = 0;
  // Host staging and scratch allocated anew (its pages faulted in) because no idle buffer of the pool
  // fit: after a first update, 0 while updates keep their shape (not staged ones, whose staging is
  // not kept between updates).
  uint64_t allocated_staging_bytes = 0;
  uint64_t out_of_order_layers = 0;  // layers that began while another was still staged
  double process_seconds = 0;        // time in processing kernels and copy-in
  uint64_t delta_pieces = 0;         // pieces that arrived as deltas
  uint64_t kept_rows = 0;            // rows of delta-only parameters left as they were: nothing in them changed
  uint64_t shadow_bytes = 0;         // memory of the delta shadow (host, or the storage's device)
  Census census;
};

// How a piece's bytes reach the engine (ReloadEngine::take_piece()).
enum class Intake {
  kCopy,    // valid only during the call: copied, staged or processed, before it returns
  kLend,    // the engine may keep them (and `owner`) until their layer is processed or the update ends
  kBorrow,  // valid until the caller's next release_borrowed(); not counted as staging
};
struct PieceBytes {
  Intake intake = Intake::kCopy;
  const void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<const void> owner;  // kLend: keeps `data` alive (null: valid until the update ends)
  Device device = Device::cpu();      // kLend: where `data` is
};

// For tests of the delta path: runs with an engine's rank and a version it may change, at
// - kBegin: as the engine begins an update, on the version its shadow holds complete, as a rank
//   whose shadow silently lost its version would (the rank then says so: update_delta_base());
// - kReport: on update_delta_base()'s answer, as a rank that reports a base it does not hold.
// Process-wide; an empty function removes it.
enum class ShadowBaseAt { kBegin, kReport };
using ShadowBaseHook = std::function<void(const sharding::RankSpec& spec, ShadowBaseAt at, uint64_t& base)>;
void set_shadow_base_hook_for_testing(ShadowBaseHook hook);

class ReloadEngine {
 public:
  // Registers every storage tensor of every parameter of `spec`; `storage` must outlive the engine.
  static Result<std::unique_ptr<ReloadEngine>> create(sharding::RankSpec spec, ModelStorage& storage,
                                                      EngineOptions options = {});

  // Starts update `version` from `senders` trainer ranks: clears coverage and staging. Input from
  // one sender in plan order holds one layer at a time; several senders (a sharded trainer) each
  // send in plan order but side by side, so layers overlap: counted, not warned about.
  // `stage`: the rank keeps serving while the update arrives, so nothing is written into storage
  // before apply_staged() (rows that arrive go into a scratch copy of the storage); apply_staged()
  // writes every layer once the rank paused. Without it, rows a kernel takes on their own are
  // written into storage as they arrive, before their layer is complete.
  Status begin(uint64_t version, int senders = 1, bool stage = false);
  // Stage while serving: every complete layer held since begin(..., stage = true) into storage,
  // in order; from here the update goes on as one that did not stage (finalize() checks it).
  Status apply_staged();
  // Writes one piece (`bytes` packed elements of `dtype`) at `dst` inside input `input` of parameter
  // `param`: 0 for the full-precision input of an online scheme; a parameter whose kernel takes
  // several checkpoint tensors has one input each (gptq_int4: 0 qweight, 1 scales, 2 g_idx; see
  // input_layout()). Processes the parameter's layer when it becomes complete.
  Status apply_input_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data,
                           size_t bytes);
  // By engine parameter name; a piece for a name this rank does not hold is recorded and reported
  // by finalize().
  Status apply_named_piece(const std::string& param, uint32_t input, const Region& dst, DType dtype, const void* data,
                           size_t bytes);
  // The one intake call: a piece of input `input` of parameter `param`, landing at `dst`, whose bytes
  // the engine holds as `bytes.intake` says (copy, lend, borrow: the three calls below).
  Status take_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, PieceBytes bytes);
  // A delta piece (FERRY_DELTA): `apply` turns the old elements of `dst` (`bytes` packed bytes, the
  // values of version `base_version`) into the new ones in place; the engine then takes them as a
  // copied piece. Refused (FailedPrecondition, nothing applied) unless the shadow holds exactly
  // `base_version`: a delta never lands on any other version.
  // `changed` receives the runs of elements (of the piece, packed) it changed, widened to whole rows
  // of `per_row` elements.
  using DeltaApply = std::function<Status(uint8_t* values, size_t bytes,
                                          std::vector<std::pair<uint64_t, uint64_t>>* changed, uint64_t per_row)>;
  // A delta as the engine may take it: applied onto host values, or onto `bytes` of values in the
  // memory of `device` (a device shadow's; returns once written). The values are rows of `per_row`
  // elements: `row_marks` (host memory, a byte per row, cleared) gets a 1 for each row the delta
  // writes in.
  using DeltaApplyOnDevice =
      std::function<Status(void* values, size_t bytes, Device device, uint64_t per_row, uint8_t* row_marks)>;
  struct DeltaSource {
    DeltaApply apply;
    DeltaApplyOnDevice apply_on_device;
  };
  Status take_delta_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                          uint64_t base_version, const DeltaSource& delta);
  Status take_delta_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                          uint64_t base_version, const DeltaApply& apply) {
    return take_delta_piece(param, input, dst, dtype, bytes, base_version, DeltaSource{apply, {}});
  }
  // The version the shadow holds complete (0: none, or the shadow is off): deltas against it apply.
  uint64_t delta_base() const { return shadow_version_; }
  // In an update: the version its delta pieces must be computed against (0: none apply). A rank
  // says it as it begins the update, so that its senders never send it deltas against the version
  // it reported at the end of the last one if its shadow no longer holds it.
  uint64_t update_delta_base() const;
  // This update's pieces do not all reach the shadow (a colocated sender's direct pieces, read in
  // place on the device): after it the shadow holds no version, and the next update comes whole.
  void drop_shadow() {
    shadow_stale_ = true;
    shadow_bypassed_ = true;
  }
  // A bucket of trainer rank `sender` arrived, saying whether that sender may send this rank deltas
  // (BucketHeader.no_deltas). Once every sender of the update said it will not, later pieces skip
  // the shadow. An update that completes with its shadow bypassed, or having heard only from
  // senders that send no deltas, frees the shadow, and the next update leaves it unwritten until a
  // sender that may send deltas is heard from in an update without bypasses (so an engine fed
  // without buckets keeps its shadow).
  void note_sender(int64_t sender, bool sends_deltas);
  // apply_input_piece() for bytes the caller lends: the engine may keep `data` (and `owner`, which
  // keeps it alive; null when the caller guarantees `data` until the update ends) until the layer
  // is processed or the update ends, and then processes it straight into registered storage, with
  // no staging copy. Pieces that cannot be processed on their own are copied at once, as by
  // apply_input_piece(). Lent bytes count as staging. `data_device`: where `data` lives; device
  // memory must be on the storage's device, and the kernels then read it in place (a colocated
  // trainer's tensors), whole rows or a whole input; other device pieces are staged through host.
  Status lend_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, std::shared_ptr<const void> owner,
                    const void* data, size_t bytes, Device data_device = Device::cpu());
  // True when lending host pieces saves work: the storage is on the host (lent pieces no kernel takes
  // alone are read in place at completion instead of being copied into staging; lent rows are
  // quantized straight into storage, as copied ones are) and no staging limit is set (lent bytes
  // count as staging, at full precision).
  bool lends_host_pieces() const;
  // apply_input_piece() for host bytes that stay valid until the caller's next release_borrowed()
  // (a transport's bucket during its callback): they are kept like lent bytes, so a layer that
  // becomes complete before then is processed straight from them into storage, with no staging
  // copy. Borrowed bytes are the caller's, so they do not count as staging.
  Status borrow_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data, size_t bytes);
  // Ends every borrow: what the engine still holds of borrowed bytes (their layers not yet complete)
  // is taken now as apply_input_piece() would have done (rows processed into storage, or into
  // scratch while staging; the rest staged), all rows at once on the work pool, and the
  // engine never reads the borrowed bytes again. An error (the staging limit) refuses the layer it
  // names; every borrow ends either way. Called again without borrows in between, it does nothing.
  Status release_borrowed();
  // Ends the update: every layer complete, no piece for an unknown tensor, census moved 0/N;
  // otherwise an error naming what is missing, unknown or moved. Rows of incomplete or refused
  // layers may already be in storage (a paused rank's storage is read by nobody until a complete
  // update lands); rollback() restores them.
  Result<EngineReport> finalize();
  // Drops staging; storage keeps whatever layers (and rows of incomplete ones) were already written.
  void abort();
  // Rollback on: copies every layer written since the last complete version back from its host
  // snapshot, in place (storage identity unchanged), ends the update, and returns the engine to
  // that version (version()). Works during an update and after one failed (finalize() or abort()).
  // FailedPrecondition when rollback is off; Internal when a registered tensor moved (there is no
  // live storage to restore into).
  Status rollback();
  RollbackMode rollback_mode() const { return rollback_; }
  uint64_t snapshot_bytes() const { return snapshots_.bytes(); }
  size_t snapshot_layers() const { return snapshots_.layers(); }
  // Idle staging kept between updates: host buffers up to what updates held at their peak (at least
  // the largest layer; see BufferPool::settle_host()), device buffers up to the largest layer.
  uint64_t pooled_bytes() const { return pool_.idle_bytes(); }

  Census census() const;
  const LayerRegistry& registry() const { return registry_; }
  const ModelStorage& storage() const { return storage_; }
  const sharding::RankSpec& spec() const { return spec_; }
  Result<uint32_t> param_index(const std::string& name) const;
  // The checkpoint tensors parameter `param`'s pieces fill.
  std::vector<kernels::StorageTensor> input_layout(uint32_t param) const;
  // The version of the last begin(); after rollback(), the version rolled back to.
  uint64_t version() const { return version_; }
  bool in_update() const { return in_update_; }
  size_t layer_count() const { return layers_.size(); }
  uint64_t staging_bytes() const { return staging_bytes_; }

 private:
  struct Layer {
    std::string name;
    std::vector<uint32_t> params;
    uint64_t staging_bytes = 0;
    bool processed = false;
    bool refused = false;
    bool staged = false;  // holds staging or scratch now
  };
  struct Param {
    uint32_t layer = 0;
    std::unique_ptr<ProcessingKernel> kernel;
    std::vector<kernels::StorageTensor> inputs;
    std::vector<Coverage> coverage;  // per input
    std::vector<TensorView> storage;  // registered views, layout order
    // Slices leave elements uncovered: these byte ranges (offset, size) of the staged input are
    // zeroed when its staging is taken.
    std::vector<std::pair<size_t, size_t>> padding;
    std::vector<Buffer> staging;      // per input, full precision, host
    std::vector<Buffer> piecewise;    // scratch copy of the storage, for rows processed on arrival while staging
    std::vector<TensorView> piecewise_views;
    std::vector<std::pair<int64_t, int64_t>> rows_done;  // [begin, end) processed on arrival
    struct Lent {
      TensorView rows;  // whole rows from `row0`, the caller's bytes (on the storage device or host)
      int64_t row0 = 0;
      std::shared_ptr<const void> owner;
      bool borrowed = false;  // valid only until release_borrowed()
      // A band (ProcessingKernel::can_process_band): rows [band, band + rows.dim(0)) of matrix
      // `row0` of a stacked parameter, `rows` as [rows, cols...]. -1: whole rows.
      int64_t band = -1;
    };
    std::vector<Lent> lent;  // processed at completion, straight into the target
    std::vector<Lent> whole;  // per input: a kept piece covering all of it, read in place of staging
    // This update, every piece came as a delta (on top of the version storage holds), changing
    // only these rows: a row-local kernel re-processes just them (engine_delta.cc).
    bool delta_only = true;
    std::vector<std::pair<int64_t, int64_t>> changed_rows;  // [begin, end), unsorted
  };

  ReloadEngine(sharding::RankSpec spec, ModelStorage& storage, EngineOptions options)
      : spec_(std::move(spec)), storage_(storage), options_(std::move(options)) {}
  Status init();
  // Pieces and their staging (engine_pieces.cc).
  std::string input_name(uint32_t param, uint32_t input) const;  // for messages
  bool complete(const Param& p) const;
  // What account() holds bytes for; names the held bytes only when the staging limit refuses them.
  enum class Held : uint8_t { kStaging, kScratch, kLent };
  Status account(Layer& layer, uint32_t param, uint32_t input, Held held, uint64_t bytes);
  // Staging for `input`, on `where` (the host, or the storage's device for device pieces).
  Status stage_input(Layer& layer, Param& p, uint32_t input, Device where);
  Status stage_piecewise(Layer& layer, Param& p);
  // `owner` non-null: lent; `borrowed`: valid until release_borrowed(); neither: during the call.
  Status apply(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data, size_t bytes,
               const std::shared_ptr<const void>* owner, Device data_device = Device::cpu(), bool borrowed = false);
  // Shared by every intake: the piece names a parameter, input, dtype and size this rank has.
  Status check_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes) const;
  // The delta shadow (engine_delta.cc): a piece's new values written into it.
  Status shadow_write(uint32_t param, uint32_t input, const Region& dst, const void* data, size_t bytes,
                      Device data_device);
  Result<TensorView> shadow_view(uint32_t param, uint32_t input, bool allocate);
  Device shadow_device() const { return options_.shadow_on_device ? storage_.device() : Device::cpu(); }
  // A delta into a device shadow: written there by the caller's kernel, the new values then lent to
  // apply().
  Status take_device_delta(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                           const TensorView& shadow, const DeltaSource& delta);
  // Processes only the changed rows of a delta-only parameter; false when it cannot (the kernel is
  // not row-local for them, or its pieces were processed on arrival), and the caller processes all.
  Result<bool> process_changed_rows(Param& p, const sharding::ParamSpec& ps, const kernels::Exec& exec);
  // `runs` of the delta codec's units (delta.h: elements, or bytes of packed int4), `per_row` of
  // them a row of `dst` (units_per_row()); with 0 (rows that are not whole bytes), every row of a
  // piece a delta changed at all.
  void note_changed_rows(Param& p, const Region& dst, const std::vector<std::pair<uint64_t, uint64_t>>& runs,
                         uint64_t per_row);
  // The delta codec's units in a row of `dst`, a box of `dtype` elements: 0 when a row of packed
  // int4 is not whole bytes.
  static uint64_t units_per_row(DType dtype, const Region& dst);
  // After an update's layers are released: the pool's host cap for the next (BufferPool::settle_host).
  void settle_pool();
  Status hold(Layer& layer, uint32_t param, uint32_t input, const Region& dst, const void* data, size_t bytes,
              const std::shared_ptr<const void>* owner, Device data_device, bool rows, bool kept, bool completes,
              bool borrowed = false, bool band = false);
  // A complete layer into storage (engine_process.cc); on failure the layer is refused and released.
  Status process(Layer& layer);
  Status process_layer(Layer& layer);
  // The layer's rollback snapshot (under RollbackMode::kHost), before its storage is first written:
  // at completion, or when rows are processed into it on arrival.
  Status snapshot_before_write(const Layer& layer);
  Status process_rows(Param& p, const sharding::ParamSpec& ps, const kernels::Exec& exec);
  Result<const Buffer*> input_buffer(Param& p, uint32_t input);
  Status process_param(Param& p, const sharding::ParamSpec& spec, const kernels::Exec& exec);
  void release(Layer& layer);

  sharding::RankSpec spec_;
  ModelStorage& storage_;
  EngineOptions options_;
  LayerRegistry registry_;
  std::vector<Param> params_;
  std::vector<Layer> layers_;
  std::map<std::string, uint32_t> by_name_;
  std::vector<std::string> unknown_;
  // Borrowed bytes the engine still holds (or whose layers completed since), as hold() kept them.
  struct Borrowed {
    uint32_t param = 0, input = 0;
    Region dst;
    const void* data = nullptr;
    size_t bytes = 0;
    bool rows = false;
  };
  std::vector<Borrowed> borrowed_;
  // Rows hold() would process on arrival now, kept for release_borrowed() to process together.
  struct ArrivalRows {
    uint32_t param = 0;
    TensorView rows;
    int64_t row0 = 0;
    Status status;
  };
  std::vector<ArrivalRows>* defer_rows_ = nullptr;
  // `rows` into their parameters' storage (or its scratch copy while staging), all at once on the
  // work pool; each that fails gets its parameter and rows in its status, each that does not counts
  // as processed on arrival.
  void process_on_arrival(std::vector<ArrivalRows>& rows);
  uint64_t version_ = 0;
  uint64_t complete_version_ = 0;
  bool in_update_ = false;
  RollbackMode rollback_ = RollbackMode::kOff;
  HostSnapshots snapshots_;
  // CUDA storage and no stream of the caller's: complete layers are processed on these in turn
  // (processing.h), forked at begin() and each joined back after its layer.
  std::unique_ptr<ProcessStreams> streams_;
  bool forked_ = false;
  BufferPool pool_;
  uint64_t largest_layer_bytes_ = 0;  // every input staged plus a scratch copy of its storage
  uint64_t allocated_at_begin_ = 0;   // pool_.allocated_bytes() when the update began
  bool staged_update_ = false;        // begin(..., stage): every layer's staging out at once
  uint64_t max_staging_ = 0;
  uint64_t staging_bytes_ = 0;
  size_t staged_layers_ = 0;  // layers with staged = true
  bool warned_out_of_order_ = false;       // in this update
  bool out_of_order_warned_once_ = false;  // at warn level, in this engine's life
  int senders_ = 1;  // of the update in progress
  EngineReport report_;
  // Delta shadow, per parameter per input; the version it holds complete (0 during an update), the
  // one it held when the update began, and whether this update's pieces all reached it.
  std::vector<std::vector<Buffer>> shadow_;
  uint64_t shadow_version_ = 0;
  uint64_t shadow_base_ = 0;
  bool shadow_stale_ = false;
  bool shadow_bypassed_ = false;        // this update: pieces bypassed the shadow (drop_shadow())
  bool heard_deltas_ = false;           // this update: a sender that may send deltas
  bool shadow_unwanted_ = false;        // the last completed update freed the shadow: leave it unwritten
  std::set<int64_t> no_delta_senders_;  // this update's senders that send no deltas
  bool stage_all_ = false;  // this update stages while the rank serves (begin(..., stage))
  bool in_delta_ = false;   // apply() is taking a delta piece's new values
  // Sets in_delta_ while one lives, whatever leaves the scope.
  struct DeltaIntake {
    explicit DeltaIntake(bool& flag) : flag_(flag) { flag_ = true; }
    ~DeltaIntake() { flag_ = false; }
    DeltaIntake(const DeltaIntake&) = delete;
    DeltaIntake& operator=(const DeltaIntake&) = delete;
    bool& flag_;
  };
};

}  // namespace ferry::reload

// The engine's construction (registration of every storage tensor), look-ups and begin(). Pieces
// and their staging are in engine_pieces.cc, processing a complete layer in engine_process.cc, the
// end of an update (finalize, census, rollback, abort) in engine_finalize.cc.
#include "reload/engine.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/parallel.h"

namespace ferry::reload {

namespace {

std::mutex shadow_hook_mu;
std::atomic<bool> shadow_hook_set{false};  // the fast path: no lock while no test set a hook
ShadowBaseHook& shadow_hook() {
  static ShadowBaseHook hook;
  return hook;
}

void run_shadow_base_hook(const sharding::RankSpec& spec, ShadowBaseAt at, uint64_t& base) {
  if (!shadow_hook_set.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(shadow_hook_mu);
  if (shadow_hook()) shadow_hook()(spec, at, base);
}

// The byte ranges of `input` (the parameter of `shape`, staged whole) that no expected region
// covers. Where every region spans whole rows these are the rows between them (a vocabulary padded
// to a multiple of TP: a few rows at the end), so that staging clears only those; otherwise the
// whole input.
std::vector<std::pair<size_t, size_t>> padding_bytes(const Shape& shape, const kernels::StorageTensor& input,
                                                     const std::vector<Region>& expected) {
  const size_t total = dtype_bytes(input.dtype, shape_numel(input.shape));
  std::vector<std::pair<int64_t, int64_t>> rows;
  bool whole_rows = input.shape == shape && !shape.empty();
  for (const Region& r : expected) {
    if (!whole_rows) break;
    for (size_t d = 1; whole_rows && d < shape.size(); ++d) {
      whole_rows = r.offset[d] == 0 && r.size[d] == shape[d];
    }
    rows.emplace_back(r.offset[0], r.offset[0] + r.size[0]);
  }
  if (!whole_rows) return {{0, total}};
  std::sort(rows.begin(), rows.end());
  const size_t row_bytes = dtype_bytes(input.dtype, shape[0] ? shape_numel(shape) / shape[0] : 0);
  std::vector<std::pair<size_t, size_t>> out;
  int64_t next = 0;
  for (const auto& [r0, r1] : rows) {
    if (r0 > next) out.emplace_back(static_cast<size_t>(next) * row_bytes, static_cast<size_t>(r0 - next) * row_bytes);
    next = std::max(next, r1);
  }
  if (next < shape[0]) {
    out.emplace_back(static_cast<size_t>(next) * row_bytes, static_cast<size_t>(shape[0] - next) * row_bytes);
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<ReloadEngine>> ReloadEngine::create(sharding::RankSpec spec, ModelStorage& storage,
                                                           EngineOptions options) {
  std::unique_ptr<ReloadEngine> e(new ReloadEngine(std::move(spec), storage, std::move(options)));
  FERRY_RETURN_IF_ERROR(e->init());
  return e;
}

Status ReloadEngine::init() {
  FERRY_RETURN_IF_ERROR(sharding::validate_rank_spec(spec_, spec_.expects));
  FERRY_RETURN_IF_ERROR(check_engine_layout(spec_));
  if (options_.delta_shadow && options_.shadow_on_device && !storage_.device().is_cuda()) {
    return Status::invalid_argument(fmt::format(
        "FERRY_DELTA_SHADOW=device: this rank's storage is on {}, not a GPU (host keeps the shadow in host memory)",
        storage_.device().to_string()));
  }
  max_staging_ = options_.max_staging_bytes;
  rollback_ = options_.rollback;
  // Resolved once (FERRY_THREADS, else the hardware's): the CPU kernels ask the system for its core
  // count on every call otherwise, a file read per call, and the engine calls them once per piece.
  if (options_.exec.threads <= 0) options_.exec.threads = static_cast<int>(host_threads());
  if (storage_.device().is_cuda() && options_.exec.stream == nullptr && options_.process_streams > 1) {
    auto streams = ProcessStreams::create(storage_.device().index, options_.process_streams);
    if (streams.ok()) streams_ = std::move(*streams);
  }
  if (!options_.kernel_factory) {
    const DType nd = options_.none_dtype;
    const EngineLayout layout = spec_.layout;
    options_.kernel_factory = [nd, layout](const sharding::ParamSpec& p) { return scheme_kernel(p, nd, layout); };
  }
  std::map<std::string, uint32_t> layer_index;
  for (uint32_t i = 0; i < spec_.params.size(); ++i) {
    const sharding::ParamSpec& p = spec_.params[i];
    auto [it, fresh] = layer_index.emplace(p.layer, static_cast<uint32_t>(layers_.size()));
    if (fresh) layers_.push_back(Layer{p.layer, {}, 0, false, false, false});
    layers_[it->second].params.push_back(i);
    if (!by_name_.emplace(p.name, i).second) return Status::invalid_argument(p.name + ": two parameters of one name");

    Param prm;
    prm.layer = it->second;
    FERRY_ASSIGN_OR_RETURN(prm.kernel, options_.kernel_factory(p));
    prm.inputs = prm.kernel->inputs();
    if (prm.inputs.size() == 1) {
      // One full-precision input: the parameter itself, covered by its slices.
      std::vector<Region> expected;
      int64_t covered = 0;
      for (const auto& s : p.slices) {
        expected.push_back(sharding::slice_dst_region(s, p));
        covered += expected.back().numel();
      }
      if (covered < shape_numel(p.shape)) prm.padding = padding_bytes(p.shape, prm.inputs[0], expected);
      prm.coverage.emplace_back(p.name, p.shape, std::move(expected));
    } else {
      // Checkpoint tensors of a quantized reload arrive whole, each under its own name.
      for (const auto& in : prm.inputs) {
        prm.coverage.emplace_back(storage_name(p.name, in.suffix), in.shape, std::vector<Region>{Region::whole(in.shape)});
      }
    }
    // Storage identity is recorded once, here; it must never change.
    FERRY_ASSIGN_OR_RETURN(auto layout, param_layout(p, options_.none_dtype, spec_.layout));
    for (const auto& t : layout) {
      const std::string name = storage_name(p.name, t.suffix);
      auto view = storage_.get(name);
      if (!view.ok()) return view.status().with_context("registering " + p.name);
      if (view->shape() != t.shape || view->dtype() != t.dtype) {
        return Status::invalid_argument(fmt::format("{}: storage {} where the {} layout needs {}{}", name,
                                                    view->describe(), scheme_name(p.scheme), dtype_name(t.dtype),
                                                    shape_to_string(t.shape)));
      }
      FERRY_RETURN_IF_ERROR(
          registry_.add(p.layer, name, t.runtime ? TensorRole::kRuntime : TensorRole::kParameter, *view));
      prm.storage.push_back(*view);
    }
    params_.push_back(std::move(prm));
  }
  // The pool keeps at most what the largest layer can hold at once: every input staged plus a
  // scratch copy of its storage.
  uint64_t largest = 0;
  for (const Layer& l : layers_) {
    uint64_t held = 0;
    for (uint32_t q : l.params) {
      for (const auto& in : params_[q].inputs) held += dtype_bytes(in.dtype, shape_numel(in.shape));
      for (const TensorView& v : params_[q].storage) held += v.nbytes();
    }
    largest = std::max(largest, held);
  }
  largest_layer_bytes_ = largest;
  pool_.set_caps(largest, largest);
  return ok_status();
}

Result<uint32_t> ReloadEngine::param_index(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Status::not_found(fmt::format("this rank holds no parameter {}", name));
  return it->second;
}

std::vector<kernels::StorageTensor> ReloadEngine::input_layout(uint32_t param) const {
  return param < params_.size() ? params_[param].inputs : std::vector<kernels::StorageTensor>{};
}

void set_shadow_base_hook_for_testing(ShadowBaseHook hook) {
  std::lock_guard<std::mutex> lock(shadow_hook_mu);
  shadow_hook_set.store(static_cast<bool>(hook), std::memory_order_release);
  shadow_hook() = std::move(hook);
}

uint64_t ReloadEngine::update_delta_base() const {
  uint64_t base = in_update_ && options_.delta_shadow ? shadow_base_ : 0;
  run_shadow_base_hook(spec_, ShadowBaseAt::kReport, base);
  return base;
}

bool ReloadEngine::lends_host_pieces() const { return storage_.device().is_cpu() && max_staging_ == 0; }

Status ReloadEngine::begin(uint64_t version, int senders, bool stage) {
  abort();
  version_ = version;
  senders_ = senders;
  stage_all_ = stage;
  // Deltas of this update apply on top of what the shadow holds now; until it completes, it holds
  // no complete version.
  shadow_base_ = shadow_version_;
  run_shadow_base_hook(spec_, ShadowBaseAt::kBegin, shadow_base_);
  shadow_version_ = 0;
  shadow_stale_ = shadow_unwanted_;
  shadow_bypassed_ = false;
  heard_deltas_ = false;
  no_delta_senders_.clear();
  in_delta_ = false;
  in_update_ = true;
  warned_out_of_order_ = false;
  unknown_.clear();
  report_ = EngineReport{};
  report_.version = version;
  allocated_at_begin_ = pool_.allocated_bytes();
  pool_.begin_period();
  staged_update_ = stage;
  for (const auto& per_input : shadow_) {
    for (const Buffer& b : per_input) report_.shadow_bytes += b.size();
  }
  for (Param& p : params_) {
    for (Coverage& c : p.coverage) c.reset();
    p.delta_only = true;
    p.changed_rows.clear();
  }
  for (Layer& l : layers_) l.processed = l.refused = false;
  forked_ = false;
  return ok_status();
}

Status ReloadEngine::apply_staged() {
  if (!in_update_) return Status::failed_precondition("apply_staged outside an update");
  stage_all_ = false;
  for (Layer& l : layers_) {
    if (l.processed || l.refused) continue;
    bool done = true;
    for (uint32_t q : l.params) done = done && complete(params_[q]);
    if (done) FERRY_RETURN_IF_ERROR(process(l));  // an incomplete one: finalize() names it
  }
  return ok_status();
}

}  // namespace ferry::reload

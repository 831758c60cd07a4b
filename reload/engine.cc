#include "reload/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/log.h"
#include "core/region_copy.h"
#include "core/settings.h"

namespace ferry::reload {

Result<RollbackMode> rollback_mode(const EngineOptions& options) {
  if (options.rollback) return *options.rollback;
  // The coordinator declares FERRY_ROLLBACK; until it does, rollback is off.
  if (!find_setting("FERRY_ROLLBACK").ok()) return RollbackMode::kOff;
  FERRY_ASSIGN_OR_RETURN(std::string v, setting_string("FERRY_ROLLBACK"));
  if (v == "host") return RollbackMode::kHost;
  if (v == "off" || v.empty()) return RollbackMode::kOff;
  return Status::invalid_argument(fmt::format("FERRY_ROLLBACK={}: expected off or host", v));
}

Result<std::unique_ptr<ReloadEngine>> ReloadEngine::create(sharding::RankSpec spec, ModelStorage& storage,
                                                           EngineOptions options) {
  std::unique_ptr<ReloadEngine> e(new ReloadEngine(std::move(spec), storage, std::move(options)));
  FERRY_RETURN_IF_ERROR(e->init());
  return e;
}

Status ReloadEngine::init() {
  FERRY_RETURN_IF_ERROR(sharding::validate_rank_spec(spec_, spec_.expects));
  FERRY_ASSIGN_OR_RETURN(max_staging_, setting_bytes("FERRY_MAX_STAGING_BYTES"));
  FERRY_ASSIGN_OR_RETURN(rollback_, ::ferry::reload::rollback_mode(options_));
  // Resolved once: the CPU kernels ask the system for its core count on every call otherwise, a
  // file read per call, and the engine calls them once per piece.
  if (options_.exec.threads <= 0) options_.exec.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!options_.kernel_factory) {
    const DType nd = options_.none_dtype;
    options_.kernel_factory = [nd](const sharding::ParamSpec& p) { return scheme_kernel(p, nd); };
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
      prm.padded = covered < shape_numel(p.shape);
      prm.coverage.emplace_back(p.name, p.shape, std::move(expected));
    } else {
      // Checkpoint tensors of a quantized reload arrive whole, each under its own name.
      for (const auto& in : prm.inputs) {
        prm.coverage.emplace_back(storage_name(p.name, in.suffix), in.shape, std::vector<Region>{Region::whole(in.shape)});
      }
    }
    // Storage identity is recorded once, here; it must never change.
    FERRY_ASSIGN_OR_RETURN(auto layout, param_layout(p, options_.none_dtype));
    for (const auto& t : layout) {
      const std::string name = storage_name(p.name, t.suffix);
      auto view = storage_.get(name);
      if (!view.ok()) return view.status().with_context("registering " + p.name);
      if (view->shape() != t.shape || view->dtype() != t.dtype) {
        return Status::invalid_argument(fmt::format("{}: storage {} where the {} layout needs {}[{}]", name,
                                                    view->describe(), p.scheme, dtype_name(t.dtype),
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
  pool_.set_cap(largest);
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

Status ReloadEngine::begin(uint64_t version) {
  abort();
  version_ = version;
  in_update_ = true;
  warned_out_of_order_ = false;
  unknown_.clear();
  report_ = EngineReport{};
  report_.version = version;
  for (Param& p : params_) {
    for (Coverage& c : p.coverage) c.reset();
  }
  for (Layer& l : layers_) l.processed = l.refused = false;
  return ok_status();
}

bool ReloadEngine::complete(const Param& p) const {
  for (const Coverage& c : p.coverage) {
    if (!c.complete()) return false;
  }
  return true;
}

// Every byte held for a layer between its first piece and its copy-in goes through here.
Status ReloadEngine::account(Layer& layer, const std::string& what, uint64_t bytes) {
  if (!layer.staged) {
    // In plan order one layer is held at a time; anything else is out-of-order input.
    std::string open;
    for (const Layer& l : layers_) {
      if (l.staged) open += (open.empty() ? "" : ", ") + l.name;
    }
    if (!open.empty()) {
      ++report_.out_of_order_layers;
      if (!warned_out_of_order_) {
        warned_out_of_order_ = true;
        FERRY_LOG_WARN("update v{}: out-of-order input: layer {} starts while {} is still incomplete; staging {:.1f} MB",
                       version_, layer.name, open, static_cast<double>(staging_bytes_ + bytes) / 1e6);
      }
    }
  }
  if (max_staging_ > 0 && staging_bytes_ + bytes > max_staging_) {
    return Status::resource_exhausted(fmt::format(
        "staging {} for layer {} would hold {:.1f} MB, over FERRY_MAX_STAGING_BYTES={:.1f} MB; layer {} is refused",
        what, layer.name, static_cast<double>(staging_bytes_ + bytes) / 1e6, static_cast<double>(max_staging_) / 1e6,
        layer.name));
  }
  layer.staged = true;
  layer.staging_bytes += bytes;
  staging_bytes_ += bytes;
  report_.peak_staging_bytes = std::max(report_.peak_staging_bytes, staging_bytes_);
  return ok_status();
}

Status ReloadEngine::stage_input(Layer& layer, Param& p, uint32_t input) {
  if (p.staging.size() != p.inputs.size()) p.staging.resize(p.inputs.size());
  if (p.staging[input].data() != nullptr) return ok_status();
  const auto& in = p.inputs[input];
  const uint64_t bytes = dtype_bytes(in.dtype, shape_numel(in.shape));
  FERRY_RETURN_IF_ERROR(account(layer, storage_name(spec_.params[&p - params_.data()].name, in.suffix), bytes));
  FERRY_ASSIGN_OR_RETURN(p.staging[input], pool_.take(bytes));
  if (p.padded) std::memset(p.staging[input].data(), 0, bytes);
  return ok_status();
}

Status ReloadEngine::stage_piecewise(Layer& layer, Param& p) {
  if (!p.piecewise.empty()) return ok_status();
  uint64_t bytes = 0;
  for (const TensorView& s : p.storage) bytes += s.nbytes();
  FERRY_RETURN_IF_ERROR(account(layer, spec_.params[&p - params_.data()].name + " (quantized scratch)", bytes));
  for (const TensorView& s : p.storage) {
    FERRY_ASSIGN_OR_RETURN(Buffer b, pool_.take(s.nbytes()));
    FERRY_ASSIGN_OR_RETURN(TensorView v, b.view(s.dtype(), s.shape()));
    p.piecewise_views.push_back(v);
    p.piecewise.push_back(std::move(b));
  }
  return ok_status();
}

Status ReloadEngine::apply_piece(uint32_t param, const Region& dst, DType dtype, const void* data, size_t bytes) {
  return apply_input_piece(param, 0, dst, dtype, data, bytes);
}

Status ReloadEngine::apply_named_piece(const std::string& param, uint32_t input, const Region& dst, DType dtype,
                                       const void* data, size_t bytes) {
  auto idx = param_index(param);
  if (!idx.ok()) {
    if (in_update_) unknown_.push_back(param);
    return idx.status();
  }
  return apply_input_piece(*idx, input, dst, dtype, data, bytes);
}

Status ReloadEngine::apply_input_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype,
                                       const void* data, size_t bytes) {
  return apply(param, input, dst, dtype, data, bytes, nullptr);
}

Status ReloadEngine::lend_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype,
                                std::shared_ptr<const void> owner, const void* data, size_t bytes, Device data_device) {
  return apply(param, input, dst, dtype, data, bytes, &owner, data_device);
}

Status ReloadEngine::apply(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data,
                           size_t bytes, const std::shared_ptr<const void>* owner, Device data_device) {
  if (!in_update_) return Status::failed_precondition("piece received outside an update");
  const bool on_device = !data_device.is_cpu();
  if (on_device && (owner == nullptr || data_device != storage_.device())) {
    return Status::invalid_argument(fmt::format("piece in {} memory for storage on {}: device pieces are lent, on the "
                                                "storage's device", data_device.to_string(), storage_.device().to_string()));
  }
  if (param >= params_.size()) {
    unknown_.push_back(fmt::format("#{}", param));
    return Status::not_found(fmt::format("piece for parameter #{}; this rank has {}", param, params_.size()));
  }
  const sharding::ParamSpec& ps = spec_.params[param];
  Param& p = params_[param];
  if (input >= p.inputs.size()) {
    return Status::invalid_argument(
        fmt::format("{}: piece for input {}; its {} kernel takes {}", ps.name, input, p.kernel->name(), p.inputs.size()));
  }
  const auto& in = p.inputs[input];
  // Built only for messages: this runs once per piece.
  const auto in_name = [&] { return p.inputs.size() == 1 ? ps.name : storage_name(ps.name, in.suffix); };
  if (dtype != in.dtype) {
    return Status::invalid_argument(
        fmt::format("{}: piece of dtype {} where {} is expected", in_name(), dtype_name(dtype), dtype_name(in.dtype)));
  }
  if (bytes != dtype_bytes(dtype, dst.numel())) {
    return Status::invalid_argument(fmt::format("{}: piece {} of {} bytes where {} elements of {} take {}", in_name(),
                                                dst.to_string(), bytes, dst.numel(), dtype_name(dtype),
                                                dtype_bytes(dtype, dst.numel())));
  }
  Layer& layer = layers_[p.layer];
  if (layer.refused) return Status::failed_precondition(fmt::format("{}: layer {} was refused", in_name(), layer.name));
  if (layer.processed) {
    return Status::invalid_argument(
        fmt::format("{}: piece {} arrives after layer {} was complete", in_name(), dst.to_string(), layer.name));
  }
  FERRY_RETURN_IF_ERROR(p.coverage[input].add(dst));
  // Row pieces are processed where their bytes are: host rows into host storage (or its scratch),
  // lent device rows straight into device storage.
  const bool rows = p.inputs.size() == 1 && (storage_.device().is_cpu() || on_device) && dst.rank() >= 1 &&
                    p.kernel->can_process_rows(dst);
  bool completes = true;
  for (uint32_t q : layer.params) completes = completes && complete(params_[q]);
  // Pieces whose bytes stay valid until the layer is processed (lent ones, and the piece that
  // completes the layer, processed within this call) are kept as they are: row pieces are
  // processed at completion straight into storage, and a piece covering a whole input is read in
  // place of its staging, by any kernel. Other row pieces are processed now into scratch; the rest
  // is staged in full precision.
  enum class Hold { kKept, kWhole, kScratch, kStaged };
  const bool kept = owner != nullptr || completes;
  const bool whole = dst.offset == Shape(in.shape.size(), 0) && dst.size == in.shape;
  const Hold hold = rows ? (kept ? Hold::kKept : Hold::kScratch) : (kept && whole ? Hold::kWhole : Hold::kStaged);
  Status st = ok_status();
  if (hold == Hold::kStaged) {
    st = stage_input(layer, p, input);
  } else if (hold == Hold::kScratch) {
    st = stage_piecewise(layer, p);
  } else if (!completes) {
    st = account(layer, in_name() + " (lent)", bytes);
  }
  if (!st.ok()) {
    // The refused layer is not partially written: its storage is only written on completion.
    layer.refused = true;
    release(layer);
    return st;
  }
  if (hold == Hold::kWhole) {
    if (p.whole.size() != p.inputs.size()) p.whole.resize(p.inputs.size());
    p.whole[input] = Param::Lent{TensorView(const_cast<void*>(data), dtype, in.shape, data_device), 0,
                                 owner != nullptr ? *owner : nullptr};
  } else if (hold == Hold::kKept) {
    p.lent.push_back(Param::Lent{TensorView(const_cast<void*>(data), dtype, dst.size, data_device), dst.offset[0],
                                 owner != nullptr ? *owner : nullptr});
  } else if (hold == Hold::kScratch) {
    // Whole rows of a row-major tensor are contiguous: the packed piece is the input as it is.
    TensorView rows(const_cast<void*>(data), dtype, dst.size);
    const auto t0 = std::chrono::steady_clock::now();
    if (Status st2 = p.kernel->process_rows(rows, dst.offset[0], p.piecewise_views, options_.exec); !st2.ok()) {
      return st2.with_context(fmt::format("{} rows {}", ps.name, dst.to_string()));
    }
    report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    p.rows_done.emplace_back(dst.offset[0], dst.offset[0] + dst.size[0]);
    ++report_.piecewise_pieces;
  } else {
    TensorView staged(p.staging[input].data(), in.dtype, in.shape);
    if (on_device) {
      // A device piece no kernel can take on its own (part of a per-tensor shard, a band of blocks):
      // through host memory, like any other staged piece.
      FERRY_ASSIGN_OR_RETURN(Buffer host, pool_.take(bytes));
      FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), data, data_device, bytes));
      Status unpacked = unpack_region(staged, dst, host.data(), bytes);
      pool_.give(std::move(host));
      if (!unpacked.ok()) return unpacked.with_context(in_name());
      ++report_.device_staged_pieces;
    } else {
      if (Status st2 = unpack_region(staged, dst, data, bytes); !st2.ok()) return st2.with_context(in_name());
    }
  }
  report_.bytes += bytes;
  report_.pieces += 1;
  return completes ? process(layer) : ok_status();
}

Result<const Buffer*> ReloadEngine::input_buffer(Param& p, uint32_t i) {
  // Inputs never staged are all padding (a shard with no expected slices): zeros.
  if (p.staging.size() != p.inputs.size()) p.staging.resize(p.inputs.size());
  if (p.staging[i].data() == nullptr) {
    const auto& in = p.inputs[i];
    const size_t bytes = dtype_bytes(in.dtype, shape_numel(in.shape));
    FERRY_ASSIGN_OR_RETURN(p.staging[i], pool_.take(bytes));
    std::memset(p.staging[i].data(), 0, bytes);
  }
  return &p.staging[i];
}

Status ReloadEngine::process_rows(Param& p, const sharding::ParamSpec& ps) {
  // Into the scratch copy when pieces were processed into it on arrival, else straight into the
  // registered storage: the layer is complete, so only a kernel error can stop it now (and rollback
  // covers that).
  const bool scratch = !p.piecewise.empty();
  const std::vector<TensorView>& target = scratch ? p.piecewise_views : p.storage;
  for (const Param::Lent& l : p.lent) {
    if (Status st = p.kernel->process_rows(l.rows, l.row0, target, options_.exec); !st.ok()) {
      return st.with_context(fmt::format("{} rows from {}", ps.name, l.row0));
    }
    p.rows_done.emplace_back(l.row0, l.row0 + l.rows.dim(0));
    if (!scratch) ++report_.direct_pieces;
  }
  // Rows no piece covered whole: staged pieces and padding, processed from staging.
  std::sort(p.rows_done.begin(), p.rows_done.end());
  const auto& in = p.inputs[0];
  const int64_t rows = in.shape[0], per_row = rows ? shape_numel(in.shape) / rows : 0;
  int64_t next = 0;
  const Device dev = storage_.device();
  ScratchArena uploads(dev);
  auto run = [&](int64_t r0, int64_t r1) -> Status {
    if (r1 <= r0) return ok_status();
    FERRY_ASSIGN_OR_RETURN(const Buffer* b, input_buffer(p, 0));
    Shape s = in.shape;
    s[0] = r1 - r0;
    TensorView v(static_cast<char*>(b->data()) + dtype_bytes(in.dtype, r0 * per_row), in.dtype, s);
    if (!scratch && !dev.is_cpu()) {
      // Device storage beside lent device rows: the staged rows go up first.
      FERRY_ASSIGN_OR_RETURN(TensorView d, uploads.allocate(in.dtype, s));
      FERRY_RETURN_IF_ERROR(copy_bytes(d.data(), dev, v.data(), Device::cpu(), d.nbytes()));
      v = d;
    }
    return p.kernel->process_rows(v, r0, target, options_.exec).with_context(ps.name);
  };
  for (const auto& [r0, r1] : p.rows_done) {
    FERRY_RETURN_IF_ERROR(run(next, r0));
    next = r1;
  }
  FERRY_RETURN_IF_ERROR(run(next, rows));
  if (uploads.bytes() > 0) FERRY_RETURN_IF_ERROR(device_synchronize(dev));  // before the uploads are freed
  if (!scratch) return ok_status();
  // Copy-in: values go into the registered storage; its identity stays.
  for (size_t i = 0; i < p.storage.size(); ++i) {
    FERRY_RETURN_IF_ERROR(copy_bytes(p.storage[i].data(), storage_.device(), p.piecewise_views[i].data(),
                                     Device::cpu(), p.storage[i].nbytes()));
  }
  return ok_status();
}

Status ReloadEngine::process_param(Param& p, const sharding::ParamSpec& ps) {
  if (!p.piecewise.empty() || !p.lent.empty()) return process_rows(p, ps);
  const Device dev = storage_.device();
  ScratchArena scratch(dev);
  std::vector<TensorView> inputs;
  for (uint32_t i = 0; i < p.inputs.size(); ++i) {
    const void* src = nullptr;
    if (i < p.whole.size() && p.whole[i].rows.data() != nullptr) {
      src = p.whole[i].rows.data();
      if (p.whole[i].rows.device() == dev) {
        // In place: host bytes into host storage, or a colocated trainer's device tensor.
        ++report_.direct_pieces;
        inputs.push_back(p.whole[i].rows);
        continue;
      }
    } else {
      FERRY_ASSIGN_OR_RETURN(const Buffer* b, input_buffer(p, i));
      src = b->data();
    }
    const auto& in = p.inputs[i];
    if (dev.is_cpu()) {
      inputs.emplace_back(const_cast<void*>(src), in.dtype, in.shape);
    } else {
      FERRY_ASSIGN_OR_RETURN(TensorView d, scratch.allocate(in.dtype, in.shape));
      FERRY_RETURN_IF_ERROR(copy_bytes(d.data(), dev, src, Device::cpu(), d.nbytes()));
      inputs.push_back(d);
    }
  }
  FERRY_RETURN_IF_ERROR(p.kernel->process(inputs, p.storage, scratch, options_.exec).with_context(ps.name));
  // Scratch is freed on return: its readers finish first. Without scratch, finalize() waits once.
  if (!dev.is_cpu() && scratch.bytes() > 0) FERRY_RETURN_IF_ERROR(device_synchronize(dev));
  return ok_status();
}

Status ReloadEngine::process(Layer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto index = static_cast<uint32_t>(&layer - layers_.data());
  if (rollback_ == RollbackMode::kHost && !snapshots_.holds(index)) {
    // Before the first byte of this layer is overwritten: every registered tensor it owns.
    std::vector<TensorView> views;
    for (size_t i : registry_.layer_tensors(layer.name)) views.push_back(registry_.tensors()[i].view);
    FERRY_RETURN_IF_ERROR(snapshots_.take(index, views).with_context("rollback snapshot of layer " + layer.name));
  }
  for (uint32_t q : layer.params) FERRY_RETURN_IF_ERROR(process_param(params_[q], spec_.params[q]));
  layer.processed = true;
  release(layer);
  report_.layers += 1;
  report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok_status();
}

void ReloadEngine::release(Layer& layer) {
  staging_bytes_ -= layer.staging_bytes;
  layer.staging_bytes = 0;
  layer.staged = false;
  for (uint32_t q : layer.params) {
    Param& p = params_[q];
    for (Buffer& b : p.staging) pool_.give(std::move(b));
    for (Buffer& b : p.piecewise) pool_.give(std::move(b));
    p.staging.clear();
    p.piecewise.clear();
    p.piecewise_views.clear();
    p.rows_done.clear();
    p.lent.clear();
    p.whole.clear();
  }
}

Result<EngineReport> ReloadEngine::finalize() {
  if (!in_update_) return Status::failed_precondition("finalize outside an update");
  // Layers whose every parameter has no expected slices complete without pieces.
  for (Layer& l : layers_) {
    if (l.processed || l.refused) continue;
    bool done = true;
    for (uint32_t q : l.params) done = done && complete(params_[q]);
    if (done) FERRY_RETURN_IF_ERROR(process(l));
  }
  std::string missing;
  int n_missing = 0;
  for (const Layer& l : layers_) {
    if (l.processed) continue;
    ++n_missing;
    std::string gaps;
    for (uint32_t q : l.params) {
      const Param& p = params_[q];
      for (size_t i = 0; i < p.coverage.size(); ++i) {
        if (p.coverage[i].complete()) continue;
        const std::string name =
            p.inputs.size() == 1 ? spec_.params[q].name : storage_name(spec_.params[q].name, p.inputs[i].suffix);
        gaps += fmt::format("{}{} missing {}", gaps.empty() ? "" : "; ", name, p.coverage[i].describe_gaps());
      }
    }
    if (l.refused) gaps += " (refused: staging limit)";
    if (n_missing <= 8) missing += fmt::format("\n  {}: {}", l.name, gaps);
  }
  // Every kernel of the update has finished (and reported its error) before the update ends: lent
  // device pieces are only guaranteed until then.
  if (Status synced = device_synchronize(storage_.device()); !synced.ok()) {
    in_update_ = false;
    for (Layer& l : layers_) release(l);
    return synced.with_context(fmt::format("update v{}", version_));
  }
  report_.census = census();
  report_.snapshot_bytes = snapshots_.bytes();
  in_update_ = false;
  for (Layer& l : layers_) release(l);
  if (!unknown_.empty()) {
    std::string names;
    for (size_t i = 0; i < unknown_.size() && i < 8; ++i) names += " " + unknown_[i];
    return Status::not_found(fmt::format("update v{} received {} pieces for tensors this rank does not hold:{}{}",
                                         version_, unknown_.size(), names, unknown_.size() > 8 ? " ..." : ""));
  }
  if (n_missing) {
    return Status::failed_precondition(
        fmt::format("update v{} left {} of {} layers incomplete (they keep their previous weights):{}{}", version_,
                    n_missing, layers_.size(), missing, n_missing > 8 ? "\n  ..." : ""));
  }
  if (report_.census.moved) {
    std::string names;
    for (size_t i = 0; i < report_.census.moved_names.size() && i < 8; ++i) names += " " + report_.census.moved_names[i];
    return Status::internal(fmt::format("census after update v{}: {} registered tensors moved:{}", version_,
                                        report_.census.to_string(), names));
  }
  // A complete version: nothing to go back to any more.
  snapshots_.drop();
  complete_version_ = version_;
  return report_;
}

Status ReloadEngine::rollback() {
  if (rollback_ != RollbackMode::kHost) {
    return Status::failed_precondition("rollback is off (EngineOptions::rollback or FERRY_ROLLBACK=host turns it on)");
  }
  for (Layer& l : layers_) release(l);
  in_update_ = false;
  const Census c = census();
  if (c.moved) {
    return Status::internal(fmt::format("rollback to v{}: {} registered tensors moved, no live storage to restore",
                                        complete_version_, c.to_string()));
  }
  const size_t layers = snapshots_.layers();
  FERRY_RETURN_IF_ERROR(snapshots_.restore().with_context(fmt::format("rollback to v{}", complete_version_)));
  FERRY_RETURN_IF_ERROR(device_synchronize(storage_.device()));
  FERRY_LOG_INFO("update v{} rolled back: {} layers restored to v{} from host snapshots", version_, layers,
                 complete_version_);
  snapshots_.drop();
  version_ = complete_version_;
  return ok_status();
}

void ReloadEngine::abort() {
  // Kernels still reading lent pieces finish before their owners may reuse the bytes.
  if (Status st = device_synchronize(storage_.device()); !st.ok()) FERRY_LOG_WARN("abort: {}", st.message());
  for (Layer& l : layers_) release(l);
  in_update_ = false;
}

Census ReloadEngine::census() const { return registry_.census(storage_.tensors()); }

}  // namespace ferry::reload

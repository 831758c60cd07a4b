#include "reload/engine.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "core/log.h"
#include "core/region_copy.h"
#include "core/settings.h"

namespace ferry::reload {

Result<std::unique_ptr<ReloadEngine>> ReloadEngine::create(sharding::RankSpec spec, ModelStorage& storage,
                                                           EngineOptions options) {
  std::unique_ptr<ReloadEngine> e(new ReloadEngine(std::move(spec), storage, std::move(options)));
  FERRY_RETURN_IF_ERROR(e->init());
  return e;
}

Status ReloadEngine::init() {
  FERRY_RETURN_IF_ERROR(sharding::validate_rank_spec(spec_, spec_.expects));
  FERRY_ASSIGN_OR_RETURN(max_staging_, setting_bytes("FERRY_MAX_STAGING_BYTES"));
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
  FERRY_ASSIGN_OR_RETURN(p.staging[input], Buffer::allocate(bytes, Device::cpu()));
  if (p.padded) FERRY_RETURN_IF_ERROR(p.staging[input].zero());
  return ok_status();
}

Status ReloadEngine::stage_piecewise(Layer& layer, Param& p) {
  if (!p.piecewise.empty()) return ok_status();
  uint64_t bytes = 0;
  for (const TensorView& s : p.storage) bytes += s.nbytes();
  FERRY_RETURN_IF_ERROR(account(layer, spec_.params[&p - params_.data()].name + " (quantized scratch)", bytes));
  for (const TensorView& s : p.storage) {
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(s.nbytes(), Device::cpu()));
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
  if (!in_update_) return Status::failed_precondition("piece received outside an update");
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
  const std::string in_name = p.inputs.size() == 1 ? ps.name : storage_name(ps.name, in.suffix);
  if (dtype != in.dtype) {
    return Status::invalid_argument(
        fmt::format("{}: piece of dtype {} where {} is expected", in_name, dtype_name(dtype), dtype_name(in.dtype)));
  }
  if (bytes != dtype_bytes(dtype, dst.numel())) {
    return Status::invalid_argument(fmt::format("{}: piece {} of {} bytes where {} elements of {} take {}", in_name,
                                                dst.to_string(), bytes, dst.numel(), dtype_name(dtype),
                                                dtype_bytes(dtype, dst.numel())));
  }
  Layer& layer = layers_[p.layer];
  if (layer.refused) return Status::failed_precondition(fmt::format("{}: layer {} was refused", in_name, layer.name));
  if (layer.processed) {
    return Status::invalid_argument(
        fmt::format("{}: piece {} arrives after layer {} was complete", in_name, dst.to_string(), layer.name));
  }
  FERRY_RETURN_IF_ERROR(p.coverage[input].add(dst));
  const bool piecewise =
      p.inputs.size() == 1 && storage_.device().is_cpu() && dst.rank() >= 1 && p.kernel->can_process_rows(dst);
  Status st = piecewise ? stage_piecewise(layer, p) : stage_input(layer, p, input);
  if (!st.ok()) {
    // The refused layer is not partially written: its storage is only written on completion.
    layer.refused = true;
    release(layer);
    return st;
  }
  if (piecewise) {
    // Whole rows of a row-major tensor are contiguous: the packed piece is the input as it is.
    TensorView rows(const_cast<void*>(data), dtype, dst.size);
    const auto t0 = std::chrono::steady_clock::now();
    FERRY_RETURN_IF_ERROR(p.kernel->process_rows(rows, dst.offset[0], p.piecewise_views, options_.exec)
                              .with_context(fmt::format("{} rows {}", ps.name, dst.to_string())));
    report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    p.rows_done.emplace_back(dst.offset[0], dst.offset[0] + dst.size[0]);
    ++report_.piecewise_pieces;
  } else {
    TensorView staged(p.staging[input].data(), in.dtype, in.shape);
    FERRY_RETURN_IF_ERROR(unpack_region(staged, dst, data, bytes).with_context(in_name));
  }
  report_.bytes += bytes;
  report_.pieces += 1;
  for (uint32_t q : layer.params) {
    if (!complete(params_[q])) return ok_status();
  }
  return process(layer);
}

Status ReloadEngine::process_param(Param& p, const sharding::ParamSpec& ps) {
  const Device dev = storage_.device();
  ScratchArena scratch(dev);
  // Inputs never staged are all padding (a shard with no expected slices): zeros.
  auto input_buffer = [&](uint32_t i) -> Result<const Buffer*> {
    if (p.staging.size() != p.inputs.size()) p.staging.resize(p.inputs.size());
    if (p.staging[i].data() == nullptr) {
      const auto& in = p.inputs[i];
      FERRY_ASSIGN_OR_RETURN(p.staging[i], Buffer::allocate(dtype_bytes(in.dtype, shape_numel(in.shape))));
      FERRY_RETURN_IF_ERROR(p.staging[i].zero());
    }
    return &p.staging[i];
  };
  if (!p.piecewise.empty()) {
    // Rows no piece covered whole: staged pieces and padding, processed from staging.
    std::sort(p.rows_done.begin(), p.rows_done.end());
    FERRY_ASSIGN_OR_RETURN(const Buffer* b, input_buffer(0));
    const auto& in = p.inputs[0];
    const int64_t rows = in.shape[0], per_row = rows ? shape_numel(in.shape) / rows : 0;
    int64_t next = 0;
    auto run = [&](int64_t r0, int64_t r1) -> Status {
      if (r1 <= r0) return ok_status();
      Shape s = in.shape;
      s[0] = r1 - r0;
      TensorView v(static_cast<char*>(b->data()) + dtype_bytes(in.dtype, r0 * per_row), in.dtype, s);
      return p.kernel->process_rows(v, r0, p.piecewise_views, options_.exec);
    };
    for (const auto& [r0, r1] : p.rows_done) {
      FERRY_RETURN_IF_ERROR(run(next, r0).with_context(ps.name));
      next = r1;
    }
    FERRY_RETURN_IF_ERROR(run(next, rows).with_context(ps.name));
    // Copy-in: values go into the registered storage; its identity stays.
    for (size_t i = 0; i < p.storage.size(); ++i) {
      FERRY_RETURN_IF_ERROR(copy_bytes(p.storage[i].data(), dev, p.piecewise_views[i].data(), Device::cpu(),
                                       p.storage[i].nbytes()));
    }
    return ok_status();
  }
  std::vector<TensorView> inputs;
  for (uint32_t i = 0; i < p.inputs.size(); ++i) {
    FERRY_ASSIGN_OR_RETURN(const Buffer* b, input_buffer(i));
    const auto& in = p.inputs[i];
    if (dev.is_cpu()) {
      inputs.emplace_back(b->data(), in.dtype, in.shape);
    } else {
      FERRY_ASSIGN_OR_RETURN(TensorView d, scratch.allocate(in.dtype, in.shape));
      FERRY_RETURN_IF_ERROR(copy_bytes(d.data(), dev, b->data(), Device::cpu(), d.nbytes()));
      inputs.push_back(d);
    }
  }
  FERRY_RETURN_IF_ERROR(p.kernel->process(inputs, p.storage, scratch, options_.exec).with_context(ps.name));
  if (!dev.is_cpu()) FERRY_RETURN_IF_ERROR(device_synchronize(dev));
  return ok_status();
}

Status ReloadEngine::process(Layer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
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
    p.staging.clear();
    p.piecewise.clear();
    p.piecewise_views.clear();
    p.rows_done.clear();
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
  report_.census = census();
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
  return report_;
}

void ReloadEngine::abort() {
  for (Layer& l : layers_) release(l);
  in_update_ = false;
}

Census ReloadEngine::census() const { return registry_.census(storage_.tensors()); }

}  // namespace ferry::reload

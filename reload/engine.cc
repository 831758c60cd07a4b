#include "reload/engine.h"

#include <chrono>

#include <fmt/format.h>

#include "core/log.h"
#include "core/region_copy.h"
#include "core/settings.h"

namespace ferry::reload {

std::string Census::to_string() const { return fmt::format("moved={}/{}", moved, registered); }

Result<std::unique_ptr<ReloadEngine>> ReloadEngine::create(sharding::RankSpec spec, ModelStorage& storage) {
  std::unique_ptr<ReloadEngine> e(new ReloadEngine(std::move(spec), storage));
  FERRY_RETURN_IF_ERROR(e->init());
  return e;
}

Status ReloadEngine::init() {
  FERRY_RETURN_IF_ERROR(sharding::validate_rank_spec(spec_, spec_.expects));
  FERRY_ASSIGN_OR_RETURN(max_staging_, setting_bytes("FERRY_MAX_STAGING_BYTES"));
  std::map<std::string, uint32_t> layer_index;
  for (uint32_t i = 0; i < spec_.params.size(); ++i) {
    const sharding::ParamSpec& p = spec_.params[i];
    auto [it, fresh] = layer_index.emplace(p.layer, static_cast<uint32_t>(layers_.size()));
    if (fresh) layers_.push_back(Layer{p.layer, {}, {}, 0, false});
    layers_[it->second].params.push_back(i);

    std::vector<Region> expected;
    int64_t covered = 0;
    for (const auto& s : p.slices) {
      expected.push_back(sharding::slice_dst_region(s, p));
      covered += expected.back().numel();
    }
    Param prm{it->second, Coverage(p.name, p.shape, std::move(expected)), {}, covered < shape_numel(p.shape)};
    // Storage identity is recorded once, here; it must never change.
    FERRY_ASSIGN_OR_RETURN(auto layout, param_layout(p, DType::kBF16));
    for (const auto& t : layout) {
      const std::string name = storage_name(p.name, t.suffix);
      auto view = storage_.get(name);
      if (!view.ok()) return view.status().with_context("registering " + p.name);
      const TensorView& v = *view;
      if (v.shape() != t.shape) {
        return Status::invalid_argument(fmt::format("{}: storage shape {} where the {} layout needs {}", name,
                                                    shape_to_string(v.shape()), p.scheme, shape_to_string(t.shape)));
      }
      registered_[name] = Identity{v.data(), v.nbytes()};
      prm.storage.push_back(name);
    }
    params_.push_back(std::move(prm));
  }
  return ok_status();
}

Status ReloadEngine::begin(uint64_t version) {
  abort();
  version_ = version;
  in_update_ = true;
  warned_out_of_order_ = false;
  report_ = EngineReport{};
  report_.version = version;
  for (Param& p : params_) p.coverage.reset();
  for (Layer& l : layers_) l.processed = false;
  return ok_status();
}

Status ReloadEngine::stage(Layer& layer, uint32_t param) {
  const sharding::ParamSpec& p = spec_.params[param];
  const uint64_t bytes = dtype_bytes(p.source_dtype, shape_numel(p.shape));
  // In plan order one layer is staged at a time; anything else is out-of-order input.
  if (layer.staging.empty() && staging_bytes_ > 0) {
    std::string open;
    for (const Layer& l : layers_) {
      if (!l.staging.empty()) open += (open.empty() ? "" : ", ") + l.name;
    }
    if (!warned_out_of_order_) {
      warned_out_of_order_ = true;
      FERRY_LOG_WARN("out-of-order input: layer {} starts while {} is still incomplete; staging {:.1f} MB", layer.name,
                     open, static_cast<double>(staging_bytes_ + bytes) / 1e6);
    }
  }
  if (max_staging_ > 0 && staging_bytes_ + bytes > max_staging_) {
    return Status::resource_exhausted(fmt::format(
        "staging {} for layer {} would hold {:.1f} MB, over FERRY_MAX_STAGING_BYTES={:.1f} MB", p.name, layer.name,
        static_cast<double>(staging_bytes_ + bytes) / 1e6, static_cast<double>(max_staging_) / 1e6));
  }
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(bytes, Device::cpu()));
  if (params_[param].padded) FERRY_RETURN_IF_ERROR(b.zero());
  layer.staging.emplace(param, std::move(b));
  layer.staging_bytes += bytes;
  staging_bytes_ += bytes;
  report_.peak_staging_bytes = std::max(report_.peak_staging_bytes, staging_bytes_);
  return ok_status();
}

Status ReloadEngine::apply_piece(uint32_t param, const Region& dst, DType dtype, const void* data, size_t bytes) {
  if (!in_update_) return Status::failed_precondition("piece received outside an update");
  if (param >= params_.size()) {
    return Status::not_found(fmt::format("piece for parameter #{}; this rank has {}", param, params_.size()));
  }
  const sharding::ParamSpec& p = spec_.params[param];
  if (dtype != p.source_dtype) {
    return Status::invalid_argument(fmt::format("{}: piece of dtype {} where {} is expected", p.name, dtype_name(dtype),
                                                dtype_name(p.source_dtype)));
  }
  Layer& layer = layers_[params_[param].layer];
  if (layer.processed) {
    return Status::invalid_argument(fmt::format("{}: piece {} arrives after layer {} was complete", p.name,
                                                dst.to_string(), layer.name));
  }
  Coverage& cov = params_[param].coverage;
  FERRY_RETURN_IF_ERROR(cov.add(dst));
  if (!layer.staging.count(param)) {
    Status st = stage(layer, param);
    if (!st.ok()) {
      release(layer);  // the refused layer is not partially written
      return st;
    }
  }
  const Buffer& b = layer.staging.at(param);
  TensorView staged(b.data(), p.source_dtype, p.shape);
  FERRY_RETURN_IF_ERROR(unpack_region(staged, dst, data, bytes).with_context(p.name));
  report_.bytes += bytes;
  report_.pieces += 1;
  for (uint32_t q : layer.params) {
    if (!params_[q].coverage.complete()) return ok_status();
  }
  return process(layer);
}

Status ReloadEngine::process(Layer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t q : layer.params) {
    const sharding::ParamSpec& p = spec_.params[q];
    FERRY_ASSIGN_OR_RETURN(kernels::Scheme scheme, kernels::parse_scheme(p.scheme));
    std::vector<TensorView> outs;
    for (const std::string& name : params_[q].storage) outs.push_back(storage_.tensors().at(name));
    auto it = layer.staging.find(q);
    // A parameter with no expected slices (an all-padding shard) has nothing staged.
    Buffer empty;
    if (it == layer.staging.end()) {
      FERRY_ASSIGN_OR_RETURN(empty, Buffer::allocate(dtype_bytes(p.source_dtype, shape_numel(p.shape))));
      FERRY_RETURN_IF_ERROR(empty.zero());
    }
    const Buffer& b = it == layer.staging.end() ? empty : it->second;
    TensorView in(b.data(), p.source_dtype, p.shape);
    FERRY_RETURN_IF_ERROR(kernels::quantize(scheme, in, p.shard_rows, outs).with_context(p.name));
  }
  layer.processed = true;
  release(layer);
  report_.layers += 1;
  report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok_status();
}

void ReloadEngine::release(Layer& layer) {
  staging_bytes_ -= layer.staging_bytes;
  layer.staging_bytes = 0;
  layer.staging.clear();
}

Result<EngineReport> ReloadEngine::finalize() {
  if (!in_update_) return Status::failed_precondition("finalize outside an update");
  // Layers whose every parameter has no expected slices complete without pieces.
  for (Layer& l : layers_) {
    if (l.processed) continue;
    bool done = true;
    for (uint32_t q : l.params) done = done && params_[q].coverage.complete();
    if (done) FERRY_RETURN_IF_ERROR(process(l));
  }
  std::string missing;
  int n_missing = 0;
  for (const Layer& l : layers_) {
    if (l.processed) continue;
    ++n_missing;
    std::string gaps;
    for (uint32_t q : l.params) {
      if (!params_[q].coverage.complete()) {
        gaps += fmt::format("{}{} missing {}", gaps.empty() ? "" : "; ", spec_.params[q].name,
                            params_[q].coverage.describe_gaps());
      }
    }
    if (n_missing <= 8) missing += fmt::format("\n  {}: {}", l.name, gaps);
  }
  report_.census = census();
  in_update_ = false;
  for (Layer& l : layers_) release(l);
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

Census ReloadEngine::census() const {
  Census c;
  c.registered = registered_.size();
  const auto& live = storage_.tensors();
  for (const auto& [name, id] : registered_) {
    auto it = live.find(name);
    if (it == live.end() || Identity{it->second.data(), it->second.nbytes()} != id) {
      ++c.moved;
      c.moved_names.push_back(name);
    }
  }
  return c;
}

}  // namespace ferry::reload

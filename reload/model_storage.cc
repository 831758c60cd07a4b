#include "reload/model_storage.h"

#include <fmt/format.h>

#include <set>

namespace ferry::reload {

std::string storage_name(const std::string& param, const std::string& suffix) {
  if (suffix == "weight" || suffix.empty()) return param;
  // Fused experts are named as vLLM names them: "experts.w13_weight" -> "experts.w13_weight_scale",
  // "experts.w13_qweight" (not "experts.weight_scale", which w13 and w2 would share).
  if (param.ends_with("_weight")) return param.substr(0, param.size() - 6) + suffix;
  const size_t dot = param.rfind('.');
  return (dot == std::string::npos ? param : param.substr(0, dot)) + "." + suffix;
}

Result<std::vector<kernels::StorageTensor>> param_layout(const sharding::ParamSpec& p, DType none_dtype,
                                                         EngineLayout engine) {
  auto layout = kernels::storage_layout(p.scheme, engine, p.shape, p.shard_rows, none_dtype);
  if (!layout.ok()) return layout.status().with_context(p.name);
  return layout;
}

Status check_engine_layout(const sharding::RankSpec& spec) {
  if (spec.layout != EngineLayout::kVllm) return ok_status();
  // vLLM's MarlinLinearKernel permutes a Marlin layer's bias too (marlin_permute_bias); SGLang's
  // does not.
  std::set<std::string> marlin;
  for (const auto& p : spec.params) {
    const bool int4 = p.scheme == Scheme::kInt4Group || p.scheme == Scheme::kGptqInt4;
    if (int4 && p.name.ends_with(".weight")) marlin.insert(p.name.substr(0, p.name.size() - 6));
  }
  for (const auto& p : spec.params) {
    if (p.name.ends_with(".bias") && marlin.count(p.name.substr(0, p.name.size() - 4))) {
      return Status::invalid_argument(fmt::format(
          "{}: vllm layout: vLLM keeps the bias of an int4 (Marlin) layer permuted (marlin_permute_bias), which "
          "ferry does not write; use the sglang layout, or leave this layer's weight out of int4_group",
          p.name));
    }
  }
  return ok_status();
}

Result<ModelStorage> ModelStorage::allocate(const sharding::RankSpec& spec, Device device, DType none_dtype) {
  FERRY_RETURN_IF_ERROR(check_engine_layout(spec));
  ModelStorage s;
  s.device_ = device;
  s.none_dtype_ = none_dtype;
  for (const auto& p : spec.params) {
    FERRY_ASSIGN_OR_RETURN(auto layout, param_layout(p, none_dtype, spec.layout));
    for (const auto& t : layout) {
      const std::string name = storage_name(p.name, t.suffix);
      FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(dtype_bytes(t.dtype, shape_numel(t.shape)), device));
      FERRY_RETURN_IF_ERROR(b.zero());
      FERRY_ASSIGN_OR_RETURN(TensorView v, b.view(t.dtype, t.shape));
      if (!s.views_.emplace(name, v).second) return Status::invalid_argument("two storage tensors named " + name);
      s.buffers_.emplace(name, std::move(b));
    }
  }
  return s;
}

Result<TensorView> ModelStorage::get(const std::string& name) const {
  auto it = views_.find(name);
  if (it == views_.end()) return Status::not_found("no storage tensor " + name);
  return it->second;
}

Status ModelStorage::replace(const std::string& name, Buffer buffer) {
  auto it = views_.find(name);
  if (it == views_.end()) return Status::not_found("no storage tensor " + name);
  if (buffer.size() < it->second.nbytes()) return Status::invalid_argument("replacement for " + name + " is too small");
  TensorView v(buffer.data(), it->second.dtype(), it->second.shape(), buffer.device());
  it->second = v;
  buffers_[name] = std::move(buffer);
  return ok_status();
}

uint64_t ModelStorage::bytes() const {
  uint64_t n = 0;
  for (const auto& [name, v] : views_) n += v.nbytes();
  return n;
}

}  // namespace ferry::reload

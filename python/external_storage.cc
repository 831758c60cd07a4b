#include "python/external_storage.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>

namespace ferry::python {

Result<std::vector<StorageEntry>> storage_entries(const sharding::RankSpec& spec, DType none_dtype) {
  std::vector<StorageEntry> out;
  for (const auto& p : spec.params) {
    FERRY_ASSIGN_OR_RETURN(auto layout, reload::param_layout(p, none_dtype, spec.layout));
    for (const auto& t : layout) {
      out.push_back({reload::storage_name(p.name, t.suffix), p.name, t.suffix, t.dtype, t.shape, t.runtime});
    }
  }
  return out;
}

Status check_external(const StorageEntry& want, const TensorView& given) {
  const size_t want_bytes = dtype_bytes(want.dtype, shape_numel(want.shape));
  const bool same_dtype = given.dtype() == want.dtype;
  const bool bytes_of_narrow = (want.dtype == DType::kF8E4M3FN || want.dtype == DType::kF8E5M2 ||
                                want.dtype == DType::kI4Packed) &&
                               (given.dtype() == DType::kU8 || given.dtype() == DType::kI8);
  const bool shape_needed = same_dtype || want.dtype != DType::kI4Packed;
  if ((!same_dtype && !bytes_of_narrow) || given.nbytes() != want_bytes || (shape_needed && given.shape() != want.shape)) {
    return Status::invalid_argument(fmt::format("{}: storage wants {}[{}] ({} bytes), the engine gives {}", want.name,
                                                dtype_name(want.dtype), fmt::join(want.shape, ", "), want_bytes,
                                                given.describe()));
  }
  if (want_bytes > 0 && reinterpret_cast<uintptr_t>(given.data()) % ((dtype_bits(want.dtype) + 7) / 8) != 0) {
    return Status::invalid_argument(fmt::format("{}: engine tensor at {} is not aligned to its elements", want.name,
                                                given.data()));
  }
  return ok_status();
}

Result<std::unique_ptr<reload::ModelStorage>> wrap_storage(const sharding::RankSpec& spec, DType none_dtype,
                                                           const std::map<std::string, TensorView>& tensors,
                                                           bool strict, std::unique_ptr<BorrowedAllocator>& allocator) {
  FERRY_ASSIGN_OR_RETURN(auto entries, storage_entries(spec, none_dtype));
  std::set<std::string> known;
  std::vector<std::string> missing;
  std::optional<Device> device;
  for (const auto& e : entries) {
    known.insert(e.name);
    auto it = tensors.find(e.name);
    if (it == tensors.end()) {
      missing.push_back(e.name);
      continue;
    }
    FERRY_RETURN_IF_ERROR(check_external(e, it->second));
    if (device && *device != it->second.device()) {
      return Status::invalid_argument(fmt::format("{} is on {}, other storage tensors on {}", e.name,
                                                  it->second.device().to_string(), device->to_string()));
    }
    device = it->second.device();
  }
  if (!missing.empty()) {
    return Status::not_found(fmt::format("{} storage tensors of rank {} are not given, e.g. {}", missing.size(),
                                         spec.tp_rank, fmt::join(missing.begin(), missing.begin() + std::min<size_t>(4, missing.size()), ", ")));
  }
  if (strict) {
    for (const auto& [name, v] : tensors) {
      if (!known.count(name)) return Status::invalid_argument(fmt::format("{} is not a storage tensor of the spec", name));
    }
  }
  const Device dev = device.value_or(Device::cpu());
  FERRY_ASSIGN_OR_RETURN(reload::ModelStorage storage, reload::ModelStorage::allocate(spec, dev, none_dtype));
  allocator = std::make_unique<BorrowedAllocator>(dev);
  for (const auto& e : entries) {
    const TensorView& given = tensors.at(e.name);
    if (given.nbytes() == 0) continue;
    allocator->lend(given.data());
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(given.nbytes(), *allocator));
    FERRY_RETURN_IF_ERROR(storage.replace(e.name, std::move(b)));
  }
  return std::make_unique<reload::ModelStorage>(std::move(storage));
}

}  // namespace ferry::python

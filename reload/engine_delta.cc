// The delta shadow: a full-precision host copy of every input of the rank, kept in step with the
// version its storage holds, so that a delta piece (only the elements that changed) can be turned
// back into the piece's complete new values and processed as any other piece. Processing from the
// complete values is what makes a delta update byte-identical to a dense one, for every scheme:
// a per-tensor or per-block scale sees every element it would have seen.
#include <fmt/format.h>

#include "core/log.h"
#include "core/region_copy.h"
#include "reload/engine.h"

namespace ferry::reload {

Result<TensorView> ReloadEngine::shadow_view(uint32_t param, uint32_t input, bool allocate) {
  if (shadow_.size() != params_.size()) shadow_.resize(params_.size());
  auto& per_input = shadow_[param];
  const auto& in = params_[param].inputs[input];
  if (per_input.size() != params_[param].inputs.size()) per_input.resize(params_[param].inputs.size());
  Buffer& b = per_input[input];
  if (b.data() == nullptr) {
    if (!allocate) return Status::internal(fmt::format("no shadow of {}", input_name(param, input)));
    FERRY_ASSIGN_OR_RETURN(b, Buffer::allocate(dtype_bytes(in.dtype, shape_numel(in.shape))));
    report_.shadow_bytes += b.size();
  }
  return TensorView(b.data(), in.dtype, in.shape);
}

Status ReloadEngine::shadow_write(uint32_t param, uint32_t input, const Region& dst, const void* data, size_t bytes,
                                  Device data_device) {
  // A delta applied in place: the bytes are the shadow's own.
  if (!shadow_.empty() && input < shadow_[param].size() && shadow_[param][input].data() != nullptr) {
    const Buffer& b = shadow_[param][input];
    const auto* p = static_cast<const uint8_t*>(data);
    if (p >= b.data_as<uint8_t>() && p < b.data_as<uint8_t>() + b.size()) return ok_status();
  }
  if (!data_device.is_cpu()) {
    // A device bucket's piece (nccl, cuda_ipc): copying every byte back to the host would cost the
    // update more than a delta could save on such links. The shadow misses it; the next update
    // comes dense.
    shadow_stale_ = true;
    return ok_status();
  }
  FERRY_ASSIGN_OR_RETURN(TensorView shadow, shadow_view(param, input, /*allocate=*/true));
  return unpack_region(shadow, dst, data, bytes);
}

Status ReloadEngine::take_delta_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                                      uint64_t base_version, const DeltaApply& apply_delta) {
  if (!in_update_) return Status::failed_precondition("delta piece received outside an update");
  FERRY_RETURN_IF_ERROR(check_piece(param, input, dst, dtype, bytes));
  const std::string name = input_name(param, input);
  if (!options_.delta_shadow) {
    return Status::failed_precondition(fmt::format(
        "{}: delta piece against v{} refused: this rank keeps no full-precision shadow (FERRY_DELTA_SHADOW=off)", name,
        base_version));
  }
  // (Pieces of this update that bypassed the shadow left other regions stale, never this one:
  // every region is written once per update.)
  if (base_version != shadow_base_) {
    return Status::failed_precondition(
        fmt::format("{}: delta piece against v{} refused, not applied: this rank's shadow holds {}", name, base_version,
                    shadow_base_ == 0 ? std::string("no complete version") : fmt::format("v{}", shadow_base_)));
  }
  FERRY_ASSIGN_OR_RETURN(TensorView shadow, shadow_view(param, input, /*allocate=*/false));
  if (!dst.inside(shadow.shape())) {
    return Status::invalid_argument(fmt::format("{}: delta piece {} outside {}", name, dst.to_string(),
                                                shape_to_string(shadow.shape())));
  }
  // Whole rows are one run of the shadow: the delta lands there in place, and the engine is lent
  // those bytes (they stay put until the update ends: every region is written once per update).
  if (const uint8_t* span = region_span(shadow, dst); span != nullptr) {
    auto* at = const_cast<uint8_t*>(span);
    FERRY_RETURN_IF_ERROR(apply_delta(at, bytes).with_context(name));
    static const std::shared_ptr<const void> kUntilTheUpdateEnds;
    Status st = apply(param, input, dst, dtype, at, bytes, &kUntilTheUpdateEnds);
    if (st.ok()) ++report_.delta_pieces;
    return st;
  }
  FERRY_ASSIGN_OR_RETURN(Buffer values, pool_.take(bytes));
  Status st = pack_region(shadow, dst, values.data(), bytes);
  if (st.ok()) st = apply_delta(static_cast<uint8_t*>(values.data()), bytes);
  if (!st.ok()) {
    pool_.give(std::move(values));
    return st.with_context(name);
  }
  // The new values go in as a copied piece: coverage, the shadow, and processing as for any other.
  st = apply(param, input, dst, dtype, values.data(), bytes, nullptr);
  pool_.give(std::move(values));
  if (st.ok()) ++report_.delta_pieces;
  return st;
}

}  // namespace ferry::reload

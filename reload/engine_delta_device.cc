// A delta into a shadow in device memory (FERRY_DELTA_SHADOW=device): the receiver decodes the
// piece's encoding on the host into runs of changed elements and their values, only those cross
// to the device, and a kernel writes them over the old values there. The complete new values are
// then lent to apply() where they lie, as a device bucket's piece would be, so the parameter is
// processed from device memory and the result is byte-identical to a dense update's.
#include <algorithm>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/region_copy.h"
#include "reload/engine.h"

namespace ferry::reload {

Status ReloadEngine::take_device_delta(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                                       const TensorView& shadow, const DeltaSource& delta) {
  const std::string name = input_name(param, input);
  if (!delta.decode)
    return Status::internal(fmt::format("{}: a delta without runs, for a shadow in device memory", name));
  if (dtype_bits(dtype) % 8 != 0) {
    return Status::invalid_argument(
        fmt::format("{}: a delta of {} elements into a device shadow", name, dtype_name(dtype)));
  }
  const size_t elem = static_cast<size_t>(dtype_bits(dtype) / 8);
  const uint64_t n = bytes / elem;
  kernels::DeltaRuns runs;
  FERRY_RETURN_IF_ERROR(delta.decode(runs).with_context(name));
  // Chunks of at most kDeltaChunkElements (a warp's share each); the decoder checked every run.
  std::vector<kernels::DeltaChunk> chunks;
  chunks.reserve(runs.runs.size());
  uint64_t value = 0;
  for (const auto& [first, count] : runs.runs) {
    if (first + count > n) return Status::data_loss(fmt::format("{}: delta run past the piece", name));
    for (uint64_t i = 0; i < count; i += kernels::kDeltaChunkElements) {
      chunks.push_back(
          {first + i, static_cast<uint32_t>(std::min<uint64_t>(count - i, kernels::kDeltaChunkElements)), value + i});
    }
    value += count;
  }
  if (value != runs.changed) return Status::data_loss(fmt::format("{}: delta runs and values disagree", name));
  // Where the new values land: the shadow itself when the region is one run of it, else a packed
  // device copy of the region, which apply() writes back into the shadow.
  const Device device = shadow.device();
  uint8_t* target = const_cast<uint8_t*>(region_span_anywhere(shadow, dst));
  std::shared_ptr<const void> owner;
  if (target == nullptr) {
    auto packed = std::make_shared<Buffer>();
    FERRY_ASSIGN_OR_RETURN(*packed, Buffer::allocate(bytes, device));
    FERRY_RETURN_IF_ERROR(pack_region_on_device(shadow, dst, packed->data(), bytes).with_context(name));
    target = packed->data_as<uint8_t>();
    owner = std::shared_ptr<const void>(packed, packed->data());
  }
  // The chunks, then the values (16-byte aligned), in one upload buffer kept between pieces.
  const size_t chunk_bytes = chunks.size() * sizeof(kernels::DeltaChunk);
  const size_t values_at = (chunk_bytes + 15) / 16 * 16;
  const size_t value_bytes = static_cast<size_t>(runs.changed) * elem;
  if (delta_upload_.size() < values_at + value_bytes) {
    delta_upload_.reset();
    FERRY_ASSIGN_OR_RETURN(delta_upload_, Buffer::allocate(std::max<size_t>(values_at + value_bytes, 1 << 20), device));
  }
  auto* up = delta_upload_.data_as<uint8_t>();
  FERRY_RETURN_IF_ERROR(copy_bytes(up, device, chunks.data(), Device::cpu(), chunk_bytes));
  FERRY_RETURN_IF_ERROR(copy_bytes(up + values_at, device, runs.values, Device::cpu(), value_bytes));
  FERRY_RETURN_IF_ERROR(kernels::scatter_delta_on_device(device.index, target, elem,
                                                         reinterpret_cast<const kernels::DeltaChunk*>(up),
                                                         chunks.size(), up + values_at, runs.xor_values)
                            .with_context(name));
  note_changed_rows(params_[param], dst, runs.runs);
  // The shadow's own bytes stay put until the update ends (every region is written once per update).
  static const std::shared_ptr<const void> kUntilTheUpdateEnds;
  bool& taking = in_delta_;
  taking = true;
  Status st = apply(param, input, dst, dtype, target, bytes, owner ? &owner : &kUntilTheUpdateEnds, device);
  taking = false;
  if (st.ok()) ++report_.delta_pieces;
  return st;
}

}  // namespace ferry::reload

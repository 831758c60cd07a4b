// A delta into a shadow in device memory (FERRY_DELTA_SHADOW=device): the caller writes the changed
// elements over the old values there (the data plane decodes the encoding on the host and a kernel
// writes it: dataplane/delta_device.h), in the shadow's own memory when the region is one run of
// it, else in a packed device copy of the region. The complete new values are then lent to apply()
// where they lie, as a device bucket's piece would be, so the parameter is processed from device
// memory and the result is byte-identical to a dense update's. The rows the delta writes in are
// marked on the device as it writes them: only those are processed again, as on the host
// (engine_delta.cc).
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/region_copy.h"
#include "reload/engine.h"

namespace ferry::reload {

Status ReloadEngine::take_device_delta(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                                       const TensorView& shadow, const DeltaSource& delta) {
  const std::string name = input_name(param, input);
  if (!delta.apply_on_device) {
    return Status::internal(
        fmt::format("{}: a delta that cannot be applied in device memory, for a device shadow", name));
  }
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
  // The rows of the piece the delta writes in, marked on the device as it writes them, noted as
  // the host path notes its runs: only those rows are processed again (process_changed_rows).
  const uint64_t rows = dst.rank() > 0 ? static_cast<uint64_t>(dst.size[0]) : 0;
  // (In the codec's units, as the device marks them; rows of packed int4 that are not whole bytes
  // are not marked, and noted whole.)
  const uint64_t per_row = rows > 0 ? units_per_row(dtype, dst) : 0;
  std::vector<uint8_t> marks(per_row > 0 ? rows : 0);
  FERRY_RETURN_IF_ERROR(
      delta.apply_on_device(target, bytes, device, per_row > 0 ? per_row : 1, per_row > 0 ? marks.data() : nullptr)
          .with_context(name));
  if (per_row > 0) {
    std::vector<std::pair<uint64_t, uint64_t>> runs;  // of elements, whole rows
    for (uint64_t r = 0; r < rows;) {
      if (marks[r] == 0) {
        ++r;
        continue;
      }
      const uint64_t r0 = r;
      while (r < rows && marks[r] != 0) ++r;
      runs.emplace_back(r0 * per_row, (r - r0) * per_row);
    }
    note_changed_rows(params_[param], dst, runs, per_row);
  } else if (rows > 0) {
    note_changed_rows(params_[param], dst, {{0, 1}}, 0);
  }
  // The shadow's own bytes stay put until the update ends (every region is written once per update).
  static const std::shared_ptr<const void> kUntilTheUpdateEnds;
  Status st;
  {
    const DeltaIntake taking(in_delta_);
    st = apply(param, input, dst, dtype, target, bytes, owner ? &owner : &kUntilTheUpdateEnds, device);
  }
  if (st.ok()) ++report_.delta_pieces;
  return st;
}

}  // namespace ferry::reload

// dataplane/delta_device.h: checks, the host's share, then the CUDA side.
#include "dataplane/delta_device.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"

namespace ferry::dataplane {
namespace {

bool aligned(const void* p, size_t elem) { return reinterpret_cast<uintptr_t>(p) % elem == 0; }

Status check_elements(size_t elem, std::initializer_list<const void*> pointers) {
  if (elem != 1 && elem != 2 && elem != 4 && elem != 8) {
    return Status::invalid_argument("device deltas take elements of 1, 2, 4 or 8 bytes");
  }
  for (const void* p : pointers) {
    if (!aligned(p, elem)) return Status::invalid_argument("device deltas: elements not aligned to their width");
  }
  return ok_status();
}

// `upload` (device memory of `device`, kept between calls) with room for `bytes`.
Result<uint8_t*> upload_room(Buffer& upload, size_t bytes, Device device) {
  if (upload.size() < bytes || upload.device() != device) {
    upload.reset();
    FERRY_ASSIGN_OR_RETURN(upload, Buffer::allocate(std::max<size_t>(bytes, size_t{1} << 20), device));
  }
  return upload.data_as<uint8_t>();
}

// The parts of an encoding (`parts`: destination, source, bytes) queued for the device with
// detail::copy_in_order, then `then()`, the kernels that read them; on any failure the copies are
// waited for before the caller may reuse their sources (a kernel's success waited for them).
template <typename Then>
Status queued_then(Device device, std::initializer_list<std::tuple<void*, const void*, size_t>> parts, Then then) {
  Status st;
  for (const auto& [to, from, bytes] : parts) {
    st = detail::copy_in_order(device.index, to, from, bytes);
    if (!st.ok()) break;
  }
  if (st.ok()) st = then();
  if (!st.ok()) detail::wait_in_order(device.index).ignore_error();
  return st;
}

// A runs encoding's r pairs (`pairs`, pair_bytes) and k values (`from`), in host or device memory,
// copied into `upload` (pairs first, values 16-byte aligned) and decoded, checked and written into
// `values` on the device (detail::apply_runs).
Status runs_through_upload(Device device, void* values, size_t n, size_t elem, const uint8_t* pairs, size_t pair_bytes,
                           uint64_t r, const uint8_t* from, uint64_t k, bool xor_values, Buffer& upload,
                           const RowMarks* rows) {
  const size_t at = round16(pair_bytes);
  const size_t value_bytes = static_cast<size_t>(k) * elem;
  FERRY_ASSIGN_OR_RETURN(uint8_t * up, upload_room(upload, at + value_bytes, device));
  return queued_then(device, {{up, pairs, pair_bytes}, {up + at, from, value_bytes}}, [&] {
    return detail::apply_runs(device.index, values, n, elem, up, pair_bytes, r, up + at, k, xor_values, rows);
  });
}

}  // namespace

Result<uint64_t> scan_changes_on_device(int device, const void* before, const void* after, size_t n, size_t elem,
                                        bool xor_values, void* bitmap, void* values) {
  FERRY_RETURN_IF_ERROR(check_elements(elem, {before, after, values}));
  uint64_t changed = 0;
  FERRY_RETURN_IF_ERROR(detail::scan_changes(device, before, after, n, elem, xor_values, bitmap, values, &changed));
  return changed;
}

Result<DeviceRuns> runs_on_device(int device, const uint8_t* bitmap, size_t n, size_t limit, Buffer& pairs) {
  FERRY_ASSIGN_OR_RETURN(uint8_t * room, upload_room(pairs, limit + 1, Device::cuda(device)));
  DeviceRuns found;
  FERRY_RETURN_IF_ERROR(detail::find_runs(device, bitmap, n, limit, room, &found));
  return found;
}

Status apply_bitmap_on_device(int device, void* dst, size_t n, size_t elem, const uint8_t* bitmap, const void* values,
                              bool xor_values, const RowMarks* rows) {
  FERRY_RETURN_IF_ERROR(check_elements(elem, {dst, values}));
  if (rows != nullptr && rows->per_row == 0) return Status::invalid_argument("device deltas: rows of 0 elements");
  return detail::apply_bitmap(device, dst, n, elem, bitmap, values, xor_values, rows);
}

Status apply_delta_on_device(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, void* values, Device device,
                             size_t n, size_t elem, Buffer& upload, const RowMarks* rows) {
  if (!device.is_cuda()) return Status::invalid_argument("apply_delta_on_device: values in host memory");
  if (rows != nullptr && rows->per_row == 0) return Status::invalid_argument("device deltas: rows of 0 elements");
  // A runs encoding goes up as it is, its pairs decoded and checked on the device. Refused there, it
  // is walked on the host below, which says why (and writes nothing).
  if ((field & 0xff) == static_cast<uint32_t>(DeltaEncoding::kRuns)) {
    DeltaRuns runs;
    if (delta_runs(field, encoded, encoded_bytes, n, elem, runs).ok()) {
      if (runs.runs == 0 && runs.changed == 0) return ok_status();  // nothing to write
      FERRY_RETURN_IF_ERROR(check_elements(elem, {values}));
      const Status st = runs_through_upload(device, values, n, elem, runs.pairs, runs.pair_bytes, runs.runs,
                                            runs.values, runs.changed, runs.xor_values, upload, rows);
      if (st.code() != StatusCode::kDataLoss) return st;
    }
  }
  DeltaBitmap bits;
  FERRY_RETURN_IF_ERROR(delta_bitmap(field, encoded, encoded_bytes, n, elem, bits));
  if (bits.changed == 0) return ok_status();  // nothing to write
  // The bitmap, then the values (16-byte aligned), in one upload buffer kept between pieces.
  const size_t map_bytes = (n + 7) / 8;
  const size_t values_at = round16(map_bytes);
  const size_t value_bytes = static_cast<size_t>(bits.changed) * elem;
  FERRY_ASSIGN_OR_RETURN(uint8_t * up, upload_room(upload, values_at + value_bytes, device));
  return queued_then(device, {{up, bits.bitmap, map_bytes}, {up + values_at, bits.values, value_bytes}}, [&] {
    return apply_bitmap_on_device(device.index, values, n, elem, up, up + values_at, bits.xor_values, rows);
  });
}

Status apply_device_runs(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, uint64_t values_at, void* values,
                         Device device, size_t n, size_t elem, Buffer& upload, const RowMarks* rows) {
  if (!device.is_cuda()) return Status::invalid_argument("apply_device_runs: values in host memory");
  if (rows != nullptr && rows->per_row == 0) return Status::invalid_argument("device deltas: rows of 0 elements");
  if (field != static_cast<uint32_t>(DeltaEncoding::kRuns)) {
    return Status::invalid_argument("apply_device_runs: a runs encoding without flags only");
  }
  if (elem == 0 || values_at == 0 || values_at > encoded_bytes || (encoded_bytes - values_at) % elem != 0) {
    return Status::data_loss(fmt::format("delta piece: values at {} of {} bytes", values_at, encoded_bytes));
  }
  // The count: at most 10 bytes before the pairs.
  uint8_t head[10] = {};
  const size_t head_room = std::min<size_t>(sizeof head, values_at);
  FERRY_RETURN_IF_ERROR(copy_bytes(head, Device::cpu(), encoded, device, head_room));
  const uint8_t* p = head;
  uint64_t r = 0;
  if (!detail::get_varint(&p, head + head_room, &r)) return Status::data_loss("delta piece: runs: no count");
  const size_t head_bytes = static_cast<size_t>(p - head);
  const uint64_t pair_bytes = values_at - head_bytes;
  const uint64_t k = (encoded_bytes - values_at) / elem;
  if (r == 0) {  // nothing to write; nothing else may follow the count
    if (pair_bytes != 0 || k != 0) {
      return Status::data_loss(fmt::format("delta piece: no runs, then {} bytes", encoded_bytes - head_bytes));
    }
    return ok_status();
  }
  if (r > pair_bytes / 2 || k > n) {
    return Status::data_loss(fmt::format("delta piece: {} runs in {} bytes of pairs, {} values", r, pair_bytes, k));
  }
  FERRY_RETURN_IF_ERROR(check_elements(elem, {values}));
  // Pairs and values copied on the device from wherever the payload put them.
  return runs_through_upload(device, values, n, elem, encoded + head_bytes, static_cast<size_t>(pair_bytes), r,
                             encoded + values_at, k, /*xor_values=*/false, upload, rows);
}

}  // namespace ferry::dataplane

#include "dataplane/piece_pack.h"

#include <cstring>

#include "core/device_copy.h"
#include "core/region_copy.h"
#include "dataplane/bucket.h"

namespace ferry::dataplane {
namespace {

// `bytes` at `where` in a bucket on `bucket_device` from host memory.
Status put(Device bucket_device, uint8_t* where, const void* from, size_t bytes) {
  if (bucket_device.is_cpu()) {
    std::memcpy(where, from, bytes);
    return ok_status();
  }
  return copy_now(bucket_device.index, where, from, bytes);
}

}  // namespace

std::optional<std::pair<uint64_t, uint64_t>> row_runs(const Shape& shape, DType dtype, const Region& src) {
  if (shape.empty()) return std::pair<uint64_t, uint64_t>{0, 0};
  for (size_t d = 2; d < shape.size(); ++d) {
    if (src.offset[d] != 0 || src.size[d] != shape[d]) return std::nullopt;
  }
  int64_t inner = 1;
  for (size_t d = 2; d < shape.size(); ++d) inner *= shape[d];
  const int64_t row = shape.size() > 1 ? shape[1] * inner : 1;
  const int64_t first = src.offset[0] * row + (shape.size() > 1 ? src.offset[1] * inner : 0);
  return std::pair<uint64_t, uint64_t>{dtype_bytes(dtype, first), dtype_bytes(dtype, row)};
}

Status host_copy(const TensorView& tensor, Buffer& host, TensorView& view) {
  if (view.device().is_cpu()) return ok_status();
  FERRY_ASSIGN_OR_RETURN(host, Buffer::allocate(tensor.nbytes()));
  FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), tensor.data(), tensor.device(), tensor.nbytes()));
  view = TensorView(host.data(), tensor.dtype(), tensor.shape());
  return ok_status();
}

Status pack_part(BucketBuilder& bucket, Device bucket_device, uint32_t param, const Region& src, const Region& dst,
                 DType dtype, const std::optional<std::pair<uint64_t, uint64_t>>& runs, const TensorView& tensor,
                 const TensorView& host, int64_t row, int64_t rows, size_t row_bytes, const DeltaBases::Base* base,
                 const DeltaOptions& delta, PackScratch& scratch, DeltaTally& tally) {
  const size_t bytes = static_cast<size_t>(rows) * row_bytes;
  if (base != nullptr) {
    // The new elements: read in place when the box is one run of the host tensor.
    const uint8_t* now = region_span(host, src);
    if (now == nullptr) {
      scratch.packed.resize(bytes);
      FERRY_RETURN_IF_ERROR(pack_region(host, src, scratch.packed.data(), bytes));
      now = scratch.packed.data();
    }
    FERRY_ASSIGN_OR_RETURN(const PartDelta pd,
                           encode_part(*base, src, now, bytes, delta, scratch.old, scratch.encoded));
    tally.elements += static_cast<uint64_t>(src.numel());
    tally.changed += pd.changed;
    if (pd.encoding != 0 && scratch.encoded.size() <= bucket.payload_room()) {
      uint8_t* where = bucket.add_delta_piece(param, dst, dtype, bytes, pd.encoding, base->version, scratch.encoded.size());
      tally.delta_bytes += scratch.encoded.size();
      tally.delta_dense_bytes += bytes;
      return put(bucket_device, where, scratch.encoded.data(), scratch.encoded.size());
    }
    tally.dense_bytes += bytes;
    return put(bucket_device, bucket.add_piece(param, dst, dtype, bytes), now, bytes);
  }
  tally.dense_bytes += bytes;
  uint8_t* where = bucket.add_piece(param, dst, dtype, bytes);
  if (bucket_device.is_cpu()) return pack_region(host, src, where, bytes);
  if (runs) {
    const auto* from = static_cast<const uint8_t*>(tensor.data()) + runs->first + static_cast<uint64_t>(row) * runs->second;
    if (runs->second == row_bytes) return copy_async(bucket_device.index, where, from, bytes);
    return copy_rows_async(bucket_device.index, where, row_bytes, from, runs->second, row_bytes, static_cast<size_t>(rows));
  }
  FERRY_ASSIGN_OR_RETURN(Buffer packed, Buffer::allocate(bytes));
  FERRY_RETURN_IF_ERROR(pack_region(host, src, packed.data(), bytes));
  return copy_now(bucket_device.index, where, packed.data(), bytes);
}

}  // namespace ferry::dataplane

#include "dataplane/piece_pack.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/device_copy.h"
#include "core/region_copy.h"
#include "dataplane/bucket.h"
#include "dataplane/delta.h"
#include "dataplane/delta_device.h"
#include "dataplane/delta_scan.h"

namespace ferry::dataplane {
namespace {

// At most this many bytes of one tensor's encodings are kept for other destinations (PackScratch).
constexpr size_t kMaxKeptEncodingBytes = size_t{256} << 20;

// `bytes` at `where` in a bucket on `bucket_device` from host memory.
Status put(Device bucket_device, uint8_t* where, const void* from, size_t bytes) {
  if (bucket_device.is_cpu()) {
    std::memcpy(where, from, bytes);
    return ok_status();
  }
  return copy_now(bucket_device.index, where, from, bytes);
}

// A compared part into the bucket: as its encoding (`pd`; `fill(where)` writes its `encoded_bytes`
// into the bucket) when it has one that fits, else as its dense bytes `now` (in the memory of
// `now_device`), or, with no `now`, box `src` of the host tensor `host`.
template <typename Fill>
Status place_compared(BucketBuilder& bucket, Device bucket_device, uint32_t param, const Region& src, const Region& dst,
                      DType dtype, size_t bytes, const PartDelta& pd, uint64_t base_version, size_t encoded_bytes,
                      Fill fill, const uint8_t* now, Device now_device, DeltaTally& tally,
                      const TensorView* host = nullptr) {
  tally.elements += static_cast<uint64_t>(src.numel());
  tally.changed += pd.changed;
  if (pd.encoding != 0 && encoded_bytes <= bucket.payload_room()) {
    // A runs encoding as it is (no flags) ends in its values: where they begin goes with it.
    const uint64_t value_bytes = pd.changed * std::max<uint64_t>(dtype_bits(dtype) / 8, 1);
    const uint64_t values_at = pd.encoding == static_cast<uint32_t>(DeltaEncoding::kRuns) && value_bytes < encoded_bytes
                                   ? encoded_bytes - value_bytes
                                   : 0;
    uint8_t* where =
        bucket.add_delta_piece(param, dst, dtype, bytes, pd.encoding, base_version, encoded_bytes, values_at);
    tally.delta_bytes += encoded_bytes;
    tally.delta_dense_bytes += bytes;
    return fill(where);
  }
  tally.dense_bytes += bytes;
  uint8_t* where = bucket.add_piece(param, dst, dtype, bytes);
  if (now == nullptr) {
    if (bucket_device.is_cpu()) return pack_region(*host, src, where, bytes);
    FERRY_ASSIGN_OR_RETURN(Buffer packed, Buffer::allocate(bytes));
    FERRY_RETURN_IF_ERROR(pack_region(*host, src, packed.data(), bytes));
    return copy_now(bucket_device.index, where, packed.data(), bytes);
  }
  if (now_device.is_cpu()) return put(bucket_device, where, now, bytes);
  return copy_bytes(where, bucket_device, now, now_device, bytes);
}

// place_compared() of an encoding held in host memory.
Status place_encoded(BucketBuilder& bucket, Device bucket_device, uint32_t param, const Region& src, const Region& dst,
                     DType dtype, size_t bytes, const PartDelta& pd, uint64_t base_version,
                     const std::vector<uint8_t>& encoded, const uint8_t* now, Device now_device, DeltaTally& tally,
                     const TensorView* host = nullptr) {
  return place_compared(
      bucket, bucket_device, param, src, dst, dtype, bytes, pd, base_version, encoded.size(),
      [&](uint8_t* where) { return put(bucket_device, where, encoded.data(), encoded.size()); }, now, now_device, tally,
      host);
}

// A part compared on the device against a copy kept there (the same shape, so a box is one run of
// both or of neither): the changed elements' bitmap, values and runs are found there, and only the
// encoding chosen (the host codec's choice) is copied into the bucket; or the part's dense bytes
// when no encoding is smaller.
Status pack_device_delta(BucketBuilder& bucket, Device bucket_device, uint32_t param, const Region& src,
                         const Region& dst, DType dtype, const TensorView& tensor, size_t bytes,
                         const DeltaBases::Base& base, const DeltaOptions& delta, PackScratch& scratch,
                         DeltaTally& tally) {
  const Device device = tensor.device();
  const size_t elem = std::max<size_t>(dtype_bits(base.dtype) / 8, 1);
  const size_t n = bytes / elem;
  const size_t map_bytes = (n + 7) / 8;
  const size_t values_at = round16(map_bytes);
  const uint8_t* now = region_span_anywhere(tensor, src);
  const uint8_t* old = region_span_anywhere(base.view(), src);
  // A box that is not one run (a rank's columns of a row-parallel weight) is packed on the device
  // first, the new elements and the old, after the scan's own room.
  const size_t packed_at = values_at + round16(bytes);
  const bool pack = now == nullptr || old == nullptr;
  const size_t need = pack ? packed_at + 2 * round16(bytes) : values_at + bytes;
  if (scratch.device_scan.size() < need || scratch.device_scan.device() != device) {
    scratch.device_scan.reset();
    FERRY_ASSIGN_OR_RETURN(scratch.device_scan, Buffer::allocate(need, device));
  }
  auto* out = scratch.device_scan.data_as<uint8_t>();
  if (pack) {
    uint8_t* packed_now = out + packed_at;
    uint8_t* packed_old = packed_now + round16(bytes);
    FERRY_RETURN_IF_ERROR(pack_region_on_device(tensor, src, packed_now, bytes));
    FERRY_RETURN_IF_ERROR(pack_region_on_device(base.view(), src, packed_old, bytes));
    now = packed_now;
    old = packed_old;
  }
  FERRY_ASSIGN_OR_RETURN(const uint64_t k,
                         scan_changes_on_device(device.index, old, now, n, elem, delta.zstd > 0, out, out + values_at));
  scratch.compared_bytes += bytes;
  PartDelta pd{0, k};
  // No encoding is smaller than its values: past that the dense bytes go, unless a delta is preferred.
  if (delta.prefer || k * elem + 1 < bytes) {
    // The runs are found on the device too; the encoding chosen (choose_delta, as the host codec
    // chooses) is copied from the device straight into the bucket, as it goes on the wire (through
    // a host vector only to be compressed, FERRY_DELTA_ZSTD).
    FERRY_ASSIGN_OR_RETURN(const DeviceRuns runs,
                           runs_on_device(device.index, out, n, map_bytes, scratch.device_pairs));
    const std::optional<std::pair<uint64_t, size_t>> found =
        runs.written ? std::optional{std::pair<uint64_t, size_t>{runs.runs, runs.pair_bytes}} : std::nullopt;
    const DeltaChoice choice{choose_delta(k, n, elem, delta.prefer, found), k};
    if (choice.encoding != DeltaEncoding::kDense) {
      // The encoding's parts: the runs' count (from here), then the pairs or the bitmap, and the
      // values (on the device).
      uint8_t head[10] = {};
      const bool by_runs = choice.encoding == DeltaEncoding::kRuns;
      const size_t head_bytes = by_runs ? static_cast<size_t>(detail::put_varint(head, runs.runs) - head) : 0;
      const uint8_t* map = by_runs ? scratch.device_pairs.data_as<uint8_t>() : out;
      const size_t map_size = by_runs ? runs.pair_bytes : map_bytes;
      const size_t value_bytes = static_cast<size_t>(k) * elem;
      const size_t size = head_bytes + map_size + value_bytes;
      const auto fill = [&](uint8_t* to, Device to_device) -> Status {
        FERRY_RETURN_IF_ERROR(copy_bytes(to, to_device, head, Device::cpu(), head_bytes));
        FERRY_RETURN_IF_ERROR(copy_bytes(to + head_bytes, to_device, map, device, map_size));
        return copy_bytes(to + head_bytes + map_size, to_device, out + values_at, device, value_bytes);
      };
      if (delta.zstd > 0) {  // compressed on the host first
        scratch.encoded.resize(size);
        FERRY_RETURN_IF_ERROR(fill(scratch.encoded.data(), Device::cpu()));
        pd = finish_part(choice, delta, scratch.encoded);
        return place_encoded(bucket, bucket_device, param, src, dst, dtype, bytes, pd, base.version, scratch.encoded,
                             now, device, tally);
      }
      // Else straight from the device into the bucket.
      pd = finish_part(choice, delta, scratch.encoded);  // no flags without zstd: the vector is not read
      return place_compared(
          bucket, bucket_device, param, src, dst, dtype, bytes, pd, base.version, size,
          [&](uint8_t* where) { return fill(where, bucket_device); }, now, device, tally);
    }
  }
  return place_compared(
      bucket, bucket_device, param, src, dst, dtype, bytes, pd, base.version, 0, [](uint8_t*) { return ok_status(); },
      now, device, tally);
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

void PackScratch::begin_update() {
  scan.trim();
  encoded_of = nullptr;
  encoded_used = 0;
  size_t held = encoded.capacity();
  for (const EncodedPart& e : encoded_parts) held += e.bytes.capacity();
  if (held > kMaxKeptEncodingBytes) {
    encoded_parts = {};
    encoded = {};
  }
  compared_bytes = 0;
  compare_seconds = copy_seconds = 0;
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
  if (base != nullptr && base->values.device().is_cuda()) {
    const auto compare_start = std::chrono::steady_clock::now();
    const Status st =
        pack_device_delta(bucket, bucket_device, param, src, dst, dtype, tensor, bytes, *base, delta, scratch, tally);
    scratch.compare_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - compare_start).count();
    return st;
  }
  if (base != nullptr) {
    // A part of a box the sender compared with the rest of the tensor (TensorScan) is encoded from
    // that scan, against the version the copy held then; any other is compared here.
    const bool scanned = scratch.scan.covers(src);
    const uint64_t version = scanned ? scratch.scan.version() : base->version;
    // The new elements: read in place when the box is one run of the host tensor (a scanned part
    // needs them only to go dense, and is packed then).
    const uint8_t* now = region_span(host, src);
    if (now == nullptr && !scanned) {
      scratch.packed.resize(bytes);
      FERRY_RETURN_IF_ERROR(pack_region(host, src, scratch.packed.data(), bytes));
      now = scratch.packed.data();
    }
    if (scratch.encoded_of != base) {
      scratch.encoded_of = base;
      scratch.encoded_used = 0;
    }
    for (size_t i = 0; i < scratch.encoded_used; ++i) {
      const PackScratch::EncodedPart& e = scratch.encoded_parts[i];
      if (e.version == version && e.src == src) {
        return place_encoded(bucket, bucket_device, param, src, dst, dtype, bytes, e.pd, version, e.bytes, now,
                             Device::cpu(), tally, &host);
      }
    }
    const auto compare_start = std::chrono::steady_clock::now();
    PartDelta pd;
    if (scanned) {
      pd = finish_part(scratch.scan.encode(src, delta.prefer, scratch.encoded), delta, scratch.encoded);
    } else {
      FERRY_ASSIGN_OR_RETURN(pd, encode_part(*base, src, now, bytes, delta, scratch.old, scratch.encoded));
      scratch.compared_bytes += bytes;
    }
    scratch.compare_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - compare_start).count();
    // (Kept while the tensor's encodings stay small: an encoding as large as its part, a delta
    // preferred over dense bytes, is compared again instead.)
    size_t kept = scratch.encoded.size();
    for (size_t i = 0; i < scratch.encoded_used; ++i) kept += scratch.encoded_parts[i].bytes.size();
    if (kept > kMaxKeptEncodingBytes) {
      return place_encoded(bucket, bucket_device, param, src, dst, dtype, bytes, pd, version, scratch.encoded, now,
                           Device::cpu(), tally, &host);
    }
    // (An entry of an earlier tensor is taken again, and the bytes it held become the scratch the
    // next part is encoded into: no part's encoding starts from fresh memory.)
    if (scratch.encoded_used == scratch.encoded_parts.size()) scratch.encoded_parts.emplace_back();
    PackScratch::EncodedPart& e = scratch.encoded_parts[scratch.encoded_used++];
    e.src = src;
    e.version = version;
    e.pd = pd;
    e.bytes.swap(scratch.encoded);
    return place_encoded(bucket, bucket_device, param, src, dst, dtype, bytes, pd, version, e.bytes, now, Device::cpu(),
                         tally, &host);
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

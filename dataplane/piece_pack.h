// How a sender packs the rows of a piece into a bucket: dense bytes (from the host, or copied
// straight from device memory into a device bucket), or a delta against the copy it kept of the
// version the rank holds (delta.h, delta_base.h). BucketSender's packing, kept apart from its
// connections and buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/status.h"
#include "core/tensor.h"
#include "dataplane/delta_base.h"
#include "dataplane/tensor_scan.h"

namespace ferry::dataplane {

class BucketBuilder;

// Where the rows of `src` lie inside a contiguous tensor of `shape` and `dtype`: the first row's
// byte offset and the bytes between rows, when every row of the box is one contiguous run.
std::optional<std::pair<uint64_t, uint64_t>> row_runs(const Shape& shape, DType dtype, const Region& src);

// `tensor` (on a device) copied into `host`, once, and viewed as `view` (a host `view` is left).
Status host_copy(const TensorView& tensor, Buffer& host, TensorView& view);

// What delta encoding did to the pieces of one destination.
struct DeltaTally {
  uint64_t dense_bytes = 0;        // payload of pieces sent whole
  uint64_t delta_bytes = 0;        // payload of delta pieces (their encodings)
  uint64_t delta_dense_bytes = 0;  // what those would have carried whole
  uint64_t elements = 0;           // elements compared against a kept copy
  uint64_t changed = 0;            // of those, changed
};

// Scratch a sender reuses across parts.
struct PackScratch {
  std::vector<uint8_t> packed, old, encoded;
  // A device compare's output (bitmap, then values) and its runs' pairs, on the device.
  Buffer device_scan, device_pairs;
  // The host encodings of the tensor compared last, by part: another destination that takes the
  // same part against the same copy (a rank of another replica: the plan cuts identical replicas'
  // buckets alike) gets the encoding again instead of a second compare. Dropped when a part of
  // another copy is compared (the first `encoded_used` entries are this copy's; the others' memory
  // is kept for the next).
  struct EncodedPart {
    Region src;
    uint64_t version = 0;
    PartDelta pd;
    std::vector<uint8_t> bytes;
  };
  const DeltaBases::Base* encoded_of = nullptr;
  std::vector<EncodedPart> encoded_parts;
  size_t encoded_used = 0;
  // The boxes of the tensor being sent that go as deltas, compared together (TensorScan): parts of
  // them are encoded from it.
  TensorScan scan;
  uint64_t compared_bytes = 0;  // bytes compared against kept copies (host or device), each part once
  double compare_seconds = 0;   // spent comparing and encoding those parts
  double copy_seconds = 0;      // spent keeping the copies the next update compares against

  // A new update: no encoding kept, nothing compared yet; the memory of earlier updates' encodings
  // and scans given back past a bound.
  void begin_update();
};

// One part of a piece (rows [row, row + rows) of it, box `src` of the local tensor) into `bucket`
// (memory on `bucket_device`) for parameter `param` at `dst`. With `base` (the copy of the version
// the rank holds), as a delta when its encoding is smaller than the dense bytes, or whenever it
// fits when `delta` prefers it; else dense: from `host` on the host, or on a device straight from
// `tensor` when its rows are `runs`. Device copies land when the bucket is sealed. A copy kept on
// the device (FERRY_DELTA_COPY=device) is compared there, its runs found there too, and the piece
// goes as the encoding chosen (copied from the device into the bucket), or as its dense bytes. A
// part of a box `scratch.scan` compared (TensorScan: the tensor's boxes at once) is encoded from
// that scan, against the version the copy held then, and goes dense packed straight from `host`.
Status pack_part(BucketBuilder& bucket, Device bucket_device, uint32_t param, const Region& src, const Region& dst,
                 DType dtype, const std::optional<std::pair<uint64_t, uint64_t>>& runs, const TensorView& tensor,
                 const TensorView& host, int64_t row, int64_t rows, size_t row_bytes, const DeltaBases::Base* base,
                 const DeltaOptions& delta, PackScratch& scratch, DeltaTally& tally);

}  // namespace ferry::dataplane

// Arbitrary bytes as a data-plane bucket: decode_bucket must refuse with DataLoss or accept a header
// whose payload pieces lie inside the bucket, without reading a byte outside it (ASan watches). A
// delta piece's encoding is then applied to a piece of its region's size, as a rank would: it
// must be taken or refused with DataLoss, never written past the values; the decoder of a device
// shadow (delta_bitmap) must take and refuse the same encodings, and mark the same elements with
// the same values.
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "dataplane/bucket.h"
#include "dataplane/delta.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // every non-UTF-8 string field would log a line
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry::dataplane;
  ferry::wire::BucketHeader header;
  const ferry::Status st = decode_bucket(data, size, &header);
  if (!st.ok()) {
    if (st.code() != ferry::StatusCode::kDataLoss || st.message().empty()) std::abort();
    return 0;
  }
  if (size < kBucketTrailerBytes || header.payload_bytes() > size - kBucketTrailerBytes) std::abort();
  const uint64_t payload = header.payload_bytes();
  for (const auto& p : header.pieces()) {
    if (p.dst_offset_size() != p.size_size()) std::abort();
    if (p.ref_alloc() != 0) continue;  // a direct piece: its bytes lie in a shared allocation
    const uint64_t in_payload = p.encoding() != 0 ? p.encoded_bytes() : p.bytes();
    if (p.offset() > payload || in_payload > payload - p.offset()) std::abort();
    if (p.encoding() == 0) continue;
    // The values of a bf16 piece of its region, bounded so that a huge region costs no memory.
    uint64_t n = 1;
    for (int64_t d : p.size()) n = d < 0 ? 0 : std::min<uint64_t>(n * static_cast<uint64_t>(d), 1 << 20);
    std::vector<uint8_t> values(n * 2, 0x5a);
    const ferry::Status applied = apply_delta(p.encoding(), data + p.offset(), in_payload, values.data(), n, 2);
    if (!applied.ok() && applied.code() != ferry::StatusCode::kDataLoss) std::abort();
    // A device shadow's decoder takes exactly what apply_delta takes, and its bitmap and values
    // write the same elements.
    DeltaBitmap bits;
    const ferry::Status decoded = delta_bitmap(p.encoding(), data + p.offset(), in_payload, n, 2, bits);
    if (decoded.ok() != applied.ok()) std::abort();
    if (!decoded.ok()) continue;
    std::vector<uint8_t> expect(n * 2, 0x5a);
    const uint8_t* v = bits.values;
    for (uint64_t e = 0; e < n; ++e) {
      if ((bits.bitmap[e / 8] >> (e % 8) & 1) == 0) continue;
      for (int i = 0; i < 2; ++i) expect[e * 2 + i] = bits.xor_values ? expect[e * 2 + i] ^ v[i] : v[i];
      v += 2;
    }
    if (expect != values) std::abort();
  }
  return 0;
}

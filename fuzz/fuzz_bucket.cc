// Arbitrary bytes as a data-plane bucket: decode_bucket must refuse with DataLoss or accept a header
// whose payload pieces lie inside the bucket, without reading a byte outside it (ASan watches).
#include <cstdint>
#include <cstdlib>

#include <google/protobuf/stubs/logging.h>

#include "dataplane/bucket.h"

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
    if (p.offset() > payload || p.bytes() > payload - p.offset()) std::abort();
  }
  return 0;
}

// The bucket format: the bytes of many pieces for one destination rank, then a BucketHeader that
// says where each piece goes, then a trailer (u32 header length, u32 magic "FRYB"). Building the
// header after the payload lets pieces be packed straight into the bucket without a second copy.
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "proto/ferry.pb.h"

namespace ferry::dataplane {

inline constexpr uint32_t kBucketMagic = 0x42595246;  // "FRYB"
inline constexpr size_t kBucketTrailerBytes = 8;
// Room beside a bucket's payload for its header and trailer: enough for the most pieces a bucket
// carries (sharding::kMaxPiecesPerBucket), each announcing one shared allocation.
inline constexpr size_t kBucketHeaderRoom = size_t{1} << 20;
// Where each piece's payload starts: a multiple of this, from the bucket's start.
inline constexpr size_t kPieceAlignment = 8;

class BucketBuilder {
 public:
  // `capacity` bytes of memory on `device` hold payload, header and trailer. In device memory the
  // caller queues the payload's copies on this thread's copy stream (core/device_copy.h) and
  // seal() lands them along with the header and trailer.
  explicit BucketBuilder(size_t capacity, Device device = Device::cpu());

  void reset(uint64_t version, int sender, uint64_t seq);
  // Bytes of payload that still fit along with one more piece header.
  size_t payload_room() const;
  size_t payload_bytes() const { return payload_; }
  size_t piece_count() const { return static_cast<size_t>(header_.pieces_size()); }
  // Reserves `bytes` of payload for a piece landing at `dst` of parameter `param`; returns where to
  // write the piece's packed elements.
  uint8_t* add_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes);
  // A delta piece (delta.h): `encoded_bytes` of payload holding what changed since `base_version` in
  // the `bytes` a dense piece would carry (a runs encoding's values from `values_at`, when not 0);
  // returns where to write the encoding.
  uint8_t* add_delta_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes, uint32_t encoding,
                           uint64_t base_version, size_t encoded_bytes, uint64_t values_at = 0);
  // A direct piece: `bytes` in `rows` rows, `row_stride` bytes apart from `offset` in the sender's
  // shared allocation `alloc` (wire::PieceHeader), with no payload.
  void add_ref_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes, uint64_t alloc, uint64_t offset,
                     uint64_t row_stride, uint64_t rows);
  // Announces a shared allocation that this bucket's or later buckets' direct pieces use.
  void add_allocation(const wire::IpcAllocation& a);
  void set_sender_nonce(uint64_t nonce) { header_.set_sender_nonce(nonce); }
  void set_no_deltas(bool none) { header_.set_no_deltas(none); }
  // Writes header and trailer; returns the bucket's total size. `checksum` adds XXH3-64 of the payload.
  Result<size_t> seal(bool checksum);
  uint8_t* data() const { return buffer_.data_as<uint8_t>(); }
  size_t capacity() const { return buffer_.size(); }
  Device device() const { return device_; }
  bool ok() const { return buffer_.data() != nullptr || buffer_.size() == 0; }

 private:
  Device device_;
  Buffer buffer_;
  std::vector<uint8_t> tail_;  // header and trailer of a device bucket, on the host
  wire::BucketHeader header_;
  size_t payload_ = 0;
  size_t header_estimate_ = 0;
};

// Checks the trailer, header and every piece's bounds (and the checksum when present).
Status decode_bucket(const uint8_t* data, size_t size, wire::BucketHeader* header);

// For a bucket the receiver cannot read directly (device memory), in steps: from its last
// kBucketTrailerBytes, how many bytes at its end hold header and trailer; then the header from
// exactly those bytes (`tail`), every piece's bounds checked against a bucket of `size` bytes;
// then the payload's checksum, when the header carries one.
Result<size_t> bucket_tail_bytes(const uint8_t* trailer, size_t size);
Status decode_bucket_header(const uint8_t* tail, size_t tail_bytes, size_t size, wire::BucketHeader* header);
Status check_payload(const wire::BucketHeader& header, const uint8_t* payload, Device device);

uint64_t payload_checksum(const uint8_t* data, size_t size);
// XXH3-64 of bytes in memory of `device` (copied to the host first when on a device).
Result<uint64_t> payload_checksum(const uint8_t* data, size_t size, Device device);

}  // namespace ferry::dataplane

#include "dataplane/bucket.h"

#include <cstring>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/device_copy.h"
#include "sharding/buckets.h"

namespace ferry::dataplane {
namespace {

constexpr size_t kHeaderFixedBytes = 80;
constexpr size_t kPieceHeaderBytes = 96;  // generous upper bound of one encoded PieceHeader
constexpr size_t kAllocationBytes = 160;  // and of one encoded IpcAllocation
static_assert(kHeaderFixedBytes + sharding::kMaxPiecesPerBucket * (kPieceHeaderBytes + kAllocationBytes + kPieceAlignment) +
                      kPieceHeaderBytes + kBucketTrailerBytes <=
                  kBucketHeaderRoom,
              "a bucket's header room holds the header of its most pieces, and their alignment");

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

uint64_t payload_checksum(const uint8_t* data, size_t size) { return XXH3_64bits(data, size); }

Result<uint64_t> payload_checksum(const uint8_t* data, size_t size, Device device) {
  if (device.is_cpu()) return payload_checksum(data, size);
  FERRY_ASSIGN_OR_RETURN(Buffer host, Buffer::allocate(size));
  FERRY_RETURN_IF_ERROR(copy_now(device.index, host.data(), data, size));
  return payload_checksum(host.data_as<uint8_t>(), size);
}

BucketBuilder::BucketBuilder(size_t capacity, Device device) : device_(device) {
  auto b = Buffer::allocate(capacity, device);
  if (b.ok()) buffer_ = std::move(*b);
}

void BucketBuilder::reset(uint64_t version, int sender, uint64_t seq) {
  header_.Clear();
  header_.set_version(version);
  header_.set_sender(sender);
  header_.set_seq(seq);
  payload_ = 0;
  header_estimate_ = kHeaderFixedBytes;
}

size_t BucketBuilder::payload_room() const {
  const size_t used = payload_ + kPieceAlignment + header_estimate_ + kPieceHeaderBytes + kBucketTrailerBytes;
  return used >= buffer_.size() ? 0 : buffer_.size() - used;
}

uint8_t* BucketBuilder::add_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes) {
  // Every piece starts 8-byte aligned, so that its elements are, whatever the sizes before it (a
  // delta piece's encoding is any number of bytes; a kernel reads a dense piece in place).
  const size_t pad = (kPieceAlignment - payload_ % kPieceAlignment) % kPieceAlignment;
  payload_ += pad;
  wire::PieceHeader* p = header_.add_pieces();
  p->set_param(param);
  for (int64_t v : dst.offset) p->add_dst_offset(v);
  for (int64_t v : dst.size) p->add_size(v);
  p->set_offset(payload_);
  p->set_bytes(bytes);
  p->set_dtype(std::string(dtype_name(dtype)));
  uint8_t* where = data() + payload_;
  payload_ += bytes;
  header_estimate_ += kPieceHeaderBytes;
  return where;
}

uint8_t* BucketBuilder::add_delta_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes, uint32_t encoding,
                                        uint64_t base_version, size_t encoded_bytes, uint64_t values_at) {
  uint8_t* where = add_piece(param, dst, dtype, encoded_bytes);
  wire::PieceHeader* p = header_.mutable_pieces(header_.pieces_size() - 1);
  p->set_bytes(bytes);
  p->set_encoding(encoding);
  p->set_base_version(base_version);
  p->set_encoded_bytes(encoded_bytes);
  if (values_at != 0) p->set_values_at(values_at);
  return where;
}

void BucketBuilder::add_ref_piece(uint32_t param, const Region& dst, DType dtype, size_t bytes, uint64_t alloc,
                                  uint64_t offset, uint64_t row_stride, uint64_t rows) {
  wire::PieceHeader* p = header_.add_pieces();
  p->set_param(param);
  for (int64_t v : dst.offset) p->add_dst_offset(v);
  for (int64_t v : dst.size) p->add_size(v);
  p->set_bytes(bytes);
  p->set_dtype(std::string(dtype_name(dtype)));
  p->set_ref_alloc(alloc);
  p->set_ref_offset(offset);
  p->set_ref_row_stride(row_stride);
  p->set_ref_rows(rows);
  header_estimate_ += kPieceHeaderBytes + 48;
}

void BucketBuilder::add_allocation(const wire::IpcAllocation& a) {
  *header_.add_allocations() = a;
  header_estimate_ += a.ByteSizeLong() + 8;
}

Result<size_t> BucketBuilder::seal(bool checksum) {
  header_.set_payload_bytes(payload_);
  uint64_t sum = 0;
  if (checksum) {
    FERRY_ASSIGN_OR_RETURN(sum, payload_checksum(data(), payload_, device_));
  }
  header_.set_checksum(sum);
  const size_t hlen = header_.ByteSizeLong();
  const size_t size = payload_ + hlen + kBucketTrailerBytes;
  if (size > buffer_.size()) return Status::internal(fmt::format("bucket header of {} bytes does not fit", hlen));
  // On a device the header and trailer are written on the host, then copied behind the payload.
  tail_.resize(device_.is_cpu() ? 0 : hlen + kBucketTrailerBytes);
  uint8_t* tail = device_.is_cpu() ? data() + payload_ : tail_.data();
  if (!header_.SerializeToArray(tail, static_cast<int>(hlen))) return Status::internal("bucket header failed to serialize");
  put_u32(tail + hlen, static_cast<uint32_t>(hlen));
  put_u32(tail + hlen + 4, kBucketMagic);
  if (!device_.is_cpu()) {
    // Also lands the payload copies queued on this thread's stream before the bucket is posted.
    FERRY_RETURN_IF_ERROR(copy_now(device_.index, data() + payload_, tail_.data(), tail_.size()));
  }
  return size;
}

Result<size_t> bucket_tail_bytes(const uint8_t* trailer, size_t size) {
  if (size < kBucketTrailerBytes) return Status::data_loss(fmt::format("bucket of {} bytes has no trailer", size));
  if (get_u32(trailer + 4) != kBucketMagic) return Status::data_loss("bucket trailer has a bad magic number");
  const size_t hlen = get_u32(trailer);
  if (hlen > size - kBucketTrailerBytes) return Status::data_loss(fmt::format("bucket header length {} exceeds the bucket", hlen));
  return hlen + kBucketTrailerBytes;
}

Status decode_bucket_header(const uint8_t* tail, size_t tail_bytes, size_t size, wire::BucketHeader* header) {
  FERRY_ASSIGN_OR_RETURN(const size_t want, bucket_tail_bytes(tail + tail_bytes - kBucketTrailerBytes, size));
  if (tail_bytes != want) return Status::internal(fmt::format("bucket tail of {} bytes, header and trailer take {}", tail_bytes, want));
  const size_t hlen = want - kBucketTrailerBytes;
  const size_t payload = size - want;
  if (!header->ParseFromArray(tail, static_cast<int>(hlen))) return Status::data_loss("bucket header does not parse");
  if (header->payload_bytes() != payload) {
    return Status::data_loss(fmt::format("bucket says {} payload bytes, carries {}", header->payload_bytes(), payload));
  }
  for (const auto& p : header->pieces()) {
    if (p.dst_offset_size() != p.size_size()) return Status::data_loss("piece region has mismatched rank");
    if (p.ref_alloc() != 0) {
      // Direct: the bytes lie in a shared allocation, checked against it when resolved.
      if (p.ref_rows() == 0 ? p.bytes() != 0 : p.bytes() % p.ref_rows() != 0 ||
                                                   (p.ref_rows() > 1 && p.ref_row_stride() < p.bytes() / p.ref_rows())) {
        return Status::data_loss(fmt::format("direct piece for parameter #{}: {} bytes in {} rows {} bytes apart",
                                             p.param(), p.bytes(), p.ref_rows(), p.ref_row_stride()));
      }
      continue;
    }
    // A delta piece's payload is its encoding, a dense one's its bytes.
    const uint64_t in_payload = p.encoding() != 0 ? p.encoded_bytes() : p.bytes();
    if (p.encoding() != 0 && p.base_version() == 0) {
      return Status::data_loss(fmt::format("delta piece for parameter #{} names no base version", p.param()));
    }
    if (p.offset() % kPieceAlignment != 0) {
      return Status::data_loss(fmt::format("piece for parameter #{} at {}, not {}-byte aligned", p.param(), p.offset(),
                                           kPieceAlignment));
    }
    if (p.offset() > payload || in_payload > payload - p.offset()) {
      return Status::data_loss(fmt::format("piece for parameter #{} at {}+{} lies outside a {}-byte payload", p.param(),
                                           p.offset(), in_payload, payload));
    }
  }
  return ok_status();
}

Status check_payload(const wire::BucketHeader& header, const uint8_t* payload, Device device) {
  if (header.checksum() == 0) return ok_status();
  FERRY_ASSIGN_OR_RETURN(uint64_t sum, payload_checksum(payload, header.payload_bytes(), device));
  if (sum != header.checksum()) {
    return Status::data_loss(fmt::format("bucket {} from sender {} failed its XXH3-64 checksum", header.seq(), header.sender()));
  }
  return ok_status();
}

Status decode_bucket(const uint8_t* data, size_t size, wire::BucketHeader* header) {
  if (size < kBucketTrailerBytes) return Status::data_loss(fmt::format("bucket of {} bytes has no trailer", size));
  FERRY_ASSIGN_OR_RETURN(const size_t tail, bucket_tail_bytes(data + size - kBucketTrailerBytes, size));
  FERRY_RETURN_IF_ERROR(decode_bucket_header(data + size - tail, tail, size, header));
  return check_payload(*header, data, Device::cpu());
}

}  // namespace ferry::dataplane

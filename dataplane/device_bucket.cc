#include "dataplane/device_bucket.h"

#include <fmt/format.h>

#include "dataplane/bucket.h"
#include "core/device_copy.h"

namespace ferry::dataplane {
namespace {

constexpr size_t kMaxIdle = 8;  // buffers kept for reuse; more are freed

}  // namespace

Status decode_device_bucket(const uint8_t* data, size_t size, Device device, wire::BucketHeader* header) {
  if (!device.is_cuda()) return Status::internal("decode_device_bucket: " + device.to_string() + " is not a device");
  if (size < kBucketTrailerBytes) return Status::data_loss(fmt::format("bucket of {} bytes has no trailer", size));
  uint8_t trailer[kBucketTrailerBytes];
  FERRY_RETURN_IF_ERROR(copy_now(device.index, trailer, data + size - kBucketTrailerBytes, kBucketTrailerBytes));
  FERRY_ASSIGN_OR_RETURN(const size_t tail_bytes, bucket_tail_bytes(trailer, size));
  std::vector<uint8_t> tail(tail_bytes);
  FERRY_RETURN_IF_ERROR(copy_now(device.index, tail.data(), data + size - tail_bytes, tail_bytes));
  FERRY_RETURN_IF_ERROR(decode_bucket_header(tail.data(), tail_bytes, size, header));
  return check_payload(*header, data, device);
}

PayloadPool::PayloadPool() : buffers_(kMaxIdle) {}

Result<std::shared_ptr<const Buffer>> PayloadPool::take(size_t bytes, Device device) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> b, buffers_.take(bytes, device));
  return std::shared_ptr<const Buffer>(std::move(b));
}

Result<std::shared_ptr<const Buffer>> PayloadPool::keep(const uint8_t* data, size_t bytes, Device from, Device to) {
  FERRY_ASSIGN_OR_RETURN(auto buf, take(bytes, to));
  // The copy lands before the sender may reuse its buffer (when this returns). A reused device
  // buffer may still be read by the engine's kernels, which are ordered before work queued later on
  // the legacy default stream (its process streams join it after every layer), so the copy waits
  // for them.
  const int stream_device = to.is_cuda() ? to.index : from.index;
  if (to.is_cuda()) FERRY_RETURN_IF_ERROR(order_default_before_copies(to.index));
  FERRY_RETURN_IF_ERROR(copy_now(stream_device, buf->data(), data, bytes));
  return buf;
}

}  // namespace ferry::dataplane

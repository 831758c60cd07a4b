// Buckets that arrive in device memory (the nccl and cuda_ipc transports hand the receiver a
// device buffer that is valid only during the callback): reading their header, and keeping their
// payload where the rank's engine can lend it until its layer is processed.
#pragma once

#include <memory>

#include "core/buffer.h"
#include "core/shared_buffers.h"
#include "core/status.h"
#include "proto/ferry.pb.h"

namespace ferry::dataplane {

// The header of a bucket of `size` bytes in memory of `device` (two small copies to the host),
// every piece's bounds checked, and the payload's checksum when it carries one.
Status decode_device_bucket(const uint8_t* data, size_t size, Device device, wire::BucketHeader* header);

// Buffers for kept payloads, reused: a payload is kept until the engine processed the layers of
// its pieces, then its buffer returns here. Safe to use from several threads.
class PayloadPool {
 public:
  PayloadPool();
  // Copies `bytes` at `data` (memory of `from`) into a buffer on `to` and waits for the copy.
  Result<std::shared_ptr<const Buffer>> keep(const uint8_t* data, size_t bytes, Device from, Device to);
  // A buffer of at least `bytes` on `device`, for the caller to fill with work queued on the
  // device's legacy default stream (ordered after the kernels that read the buffer last).
  Result<std::shared_ptr<const Buffer>> take(size_t bytes, Device device);
  size_t idle() const { return buffers_.idle(); }

 private:
  SharedBufferPool buffers_;
};

}  // namespace ferry::dataplane

#pragma once

#include <memory>

#include "transport/transport.h"

namespace ferry::transport {

// NCCL point to point: one two-rank communicator per connection (rank 0 the sender, rank 1 the
// receiver); the receiver's callback gets DEVICE memory on the device that was current when the
// transport was created (see nccl_wire.h). Unavailable without a CUDA device.
Result<std::unique_ptr<Transport>> create_nccl_transport(const TransportOptions& options);

}  // namespace ferry::transport

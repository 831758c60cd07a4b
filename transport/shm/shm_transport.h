// shm: a POSIX shared-memory ring per sender, between processes on one node (layout in
// shm_ring.h). The sender copies a bucket into the ring once; the receiver's callback gets a
// pointer into the ring. A dead peer is found by its pid and becomes Unavailable.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace ferry::transport {

Result<std::unique_ptr<Transport>> create_shm_transport(const TransportOptions& options);

}  // namespace ferry::transport

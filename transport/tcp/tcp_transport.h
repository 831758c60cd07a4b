// tcp: the transport that always works. Boost.Asio; each bucket is an 8-byte little-endian length
// and its bytes; a connection keeps several buckets in flight, written in order.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace ferry::transport {

Result<std::unique_ptr<Transport>> create_tcp_transport(const TransportOptions& options);

}  // namespace ferry::transport

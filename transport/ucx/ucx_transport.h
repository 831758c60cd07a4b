// ucx: UCP active messages over whatever UCX picks (UCX_TLS is the user's to set); host memory, and
// device memory through pinned staging when this UCX build lacks CUDA support.
#pragma once

#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace ferry::transport {

Result<std::unique_ptr<Transport>> create_ucx_transport(const TransportOptions& options);

// What UCX prints about a ucx connection's endpoint (ucp_ep_print_info: its lanes and the
// transports under them); empty for another transport's connection. For tests and diagnostics.
std::string ucx_endpoint_info(Connection& c);

// Bytes each lane of a ucx connection has sent: one lane to another host, up to two (one per core)
// to a receiver on this host; empty for another transport's connection. For tests and diagnostics.
std::vector<uint64_t> ucx_lane_bytes(Connection& c);

}  // namespace ferry::transport

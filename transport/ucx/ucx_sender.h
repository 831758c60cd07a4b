// ucx's sending side (ucx_sender.cc, its endpoints in ucx_connection.cc): connections, for
// ucx_transport.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transport/transport.h"

namespace ferry::transport::ucx {

class Engine;

// How many lanes a same-host connection gets: one per core (host_threads()), at most kMaxSameHostLanes (the copies
// of two buckets at once; the receiver's own thread and the callbacks need the rest).
uint32_t same_host_lanes();

// A connection to the listener at host:port. Another host: one endpoint on `shared`, with peer
// error handling. This host (`same_host`): one lane per listener in `local_ports` (at most
// same_host_lanes(); one lane to `port` when fewer than two), each on an engine of its own. Every
// lane's first message is a hello carrying `credential`.
Result<std::unique_ptr<Connection>> connect_sender(const std::shared_ptr<Engine>& shared, const std::string& host,
                                                   uint16_t port, const std::vector<uint16_t>& local_ports,
                                                   bool same_host, std::string_view credential, Deadline deadline);

// ucx_endpoint_info() and ucx_lane_bytes() (ucx_transport.h).
std::string describe_connection(Connection& c);
std::vector<uint64_t> lane_bytes(Connection& c);

}  // namespace ferry::transport::ucx

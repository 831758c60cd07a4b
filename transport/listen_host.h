// Where listeners may listen: TransportOptions::listen_host, and for the libraries that listen on
// every network interface unless told otherwise (UCX's tcp transport, NCCL's bootstrap), the
// interface that holds it; and whether a connected socket's peer is on this host.
#pragma once

#include <string>

#include "core/status.h"

namespace ferry::transport {

// The name of the network interface that holds address `host` ("lo" for 127.0.0.1); empty when
// `host` is a wildcard (0.0.0.0, ::): every interface. NotFound when no interface holds it.
Result<std::string> interface_of(const std::string& host);

// Whether the peer of connected socket `fd` is on this host: a Unix socket, or TCP to a loopback
// address or to this end's own (the kernel routes a connection to one of its own addresses over
// loopback). False when it cannot tell.
bool peer_on_this_host(int fd);

}  // namespace ferry::transport

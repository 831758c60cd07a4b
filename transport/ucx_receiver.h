// ucx, receiving end: a sockaddr listener; each accepted endpoint's buckets reach the callback
// whole and in order, on the progress thread (so never two at once).
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"
#include "transport/ucx_engine.h"

namespace ferry::transport::ucx {

class Receiver;

// Starts listening on `host` (an IPv4 address) and returns "ucx://host:port".
Result<std::shared_ptr<Receiver>> start_receiver(std::shared_ptr<Engine> engine, const std::string& host,
                                                 uint64_t max_bucket, BucketCallback on_bucket,
                                                 PeerClosedCallback on_closed, std::string* blob);
// Closes the listener and every accepted endpoint; waits until the progress thread has done so.
void stop_receiver(const std::shared_ptr<Receiver>& r);

}  // namespace ferry::transport::ucx

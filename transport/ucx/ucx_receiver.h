// ucx, receiving end: a sockaddr listener; each sender's buckets (over one endpoint, or over the
// lanes of a same-host connection, joined by their LaneHeader) reach the callback whole and in
// order, on a progress thread. The receivers that one host's lanes reach share a StreamTable, so a
// stream's buckets may be delivered on either's thread; the transport (ucx_transport.cc) makes
// their callbacks take turns.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"
#include "transport/ucx/ucx_engine.h"

namespace ferry::transport::ucx {

class Receiver;
// What receivers that share it know of the streams whose lanes reach them (ucx_receiver.cc).
struct StreamTable;
std::shared_ptr<StreamTable> make_stream_table();

// Where a receiver listens: its port, and the blob "ucx://host:port[/boot-id]".
struct Listening {
  std::string blob;
  uint16_t port = 0;
};

// Starts listening on `host` (an IPv4 address), on a port of its choosing. Every accepted endpoint
// must say hello (kHelloId) with a credential that `admit` takes within kAdmissionDeadline before
// anything else it sends is read (ucx_admission.h); its buckets may be as large as its admission
// lets them, `default_max_bucket` where that sets no limit.
Result<std::shared_ptr<Receiver>> start_receiver(std::shared_ptr<Engine> engine, const std::string& host,
                                                 uint64_t default_max_bucket, BucketCallback on_bucket,
                                                 PeerClosedCallback on_closed, AdmitCallback admit, Listening* where,
                                                 std::shared_ptr<StreamTable> table = nullptr);
// Closes the listener and every accepted endpoint; waits until the progress thread has done so.
void stop_receiver(const std::shared_ptr<Receiver>& r);

}  // namespace ferry::transport::ucx

// Admission on the control sockets of the device transports (cuda_ipc, nccl): sockets accepted and
// not yet admitted wait here, off the thread's other work, until their credential frame
// (admission.h) is complete, refused, or late. Nothing else is read from them before.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "transport/common/socket.h"
#include "transport/transport.h"

namespace ferry::transport::net {

class Admissions {
 public:
  // `transport` names the transport in the log; `default_max_bucket` is the bucket limit of a
  // connection `admit` sets none for (TransportOptions::max_received_bucket()).
  Admissions(std::string transport, AdmitCallback admit, uint64_t default_max_bucket)
      : transport_(std::move(transport)), admit_(std::move(admit)), default_max_bucket_(default_max_bucket) {}

  // A freshly accepted socket; it has kAdmissionDeadline to present its credential.
  void add(Socket s);
  // Reads what the pending sockets hold now, never past their credential frame. Each admitted one
  // goes to `on_admitted` with its admission (bucket limit resolved); a refused, malformed, closed
  // or late one is closed (and logged once). Sets `*progress` when anything changed.
  void poll(const std::function<void(Socket, const Admission&)>& on_admitted, bool* progress);
  // Adds the pending sockets to a poll set.
  void append_fds(std::vector<int>& fds) const;
  // `cap`, or less when a pending socket's deadline comes sooner (ms).
  int timeout_ms(int cap) const;
  // Closes every pending socket.
  void clear() { pending_.clear(); }

 private:
  struct Pending {
    Socket sock;
    Deadline deadline;
    std::string who;
    std::string frame;   // what arrived of the credential frame
    size_t want = 0;     // the frame's whole size, once its header is in
  };
  // Reads once; true when `p` is done (admitted or closed).
  bool step(Pending& p, const std::function<void(Socket, const Admission&)>& on_admitted, bool* progress);

  std::string transport_;
  AdmitCallback admit_;
  uint64_t default_max_bucket_;
  std::vector<Pending> pending_;
};

}  // namespace ferry::transport::net

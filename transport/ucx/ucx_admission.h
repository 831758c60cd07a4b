// ucx's admission, for its receivers (ucx_receiver.cc): the endpoints a receiver accepted that have
// not presented an admitted credential yet. An endpoint's first message must be a hello
// (kHelloId) carrying its sender's credential, within kAdmissionDeadline; until it is admitted,
// anything else it sends closes it, and without a hello by the deadline it is closed.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "transport/transport.h"

namespace ferry::transport::ucx {

class Engine;

// The sender's address of a connection request, for the log.
std::string client_address(ucp_conn_request_h req);

// Every member is touched on the receiver's progress thread only.
class Gate : public std::enable_shared_from_this<Gate> {
 public:
  // `default_max_bucket`: the bucket limit of an endpoint `admit` sets none for.
  Gate(std::shared_ptr<Engine> engine, AdmitCallback admit, uint64_t default_max_bucket)
      : engine_(std::move(engine)), admit_(std::move(admit)), default_max_bucket_(default_max_bucket) {}

  // An endpoint accepted from `who`; closed at kAdmissionDeadline unless admitted by then.
  void add(ucp_ep_h ep, std::string who);
  // Judges `ep`'s hello, `length` bytes at `data` (`rendezvous`: too large to come eagerly, so
  // refused unread, as is one over kMaxCredentialBytes). Admitted, `ep` leaves the gate and its
  // admission (bucket limit resolved) comes back. Refused, the sender is told why and the endpoint
  // is closed when the sender closes its end or at the deadline, whichever comes first (a same-host
  // sender may still be wiring its endpoint up, and UCX 1.13 aborts a worker torn down in the middle
  // of that: UcxConnection::fail_when_wired()). Nothing either when `ep` is not waiting (admitted
  // already, or refused).
  std::optional<Admission> hello(ucp_ep_h ep, const void* data, size_t length, bool rendezvous);
  // True when `ep` is not admitted: a message from it other than a hello is not read, and the
  // endpoint is closed (left to its deadline if it was refused already).
  bool holds(ucp_ep_h ep);
  // `ep` failed. True when it was never admitted: it is closed once the worker is drained, with
  // nothing to report.
  bool failed(ucp_ep_h ep);
  // Closes every endpoint still waiting (the receiver stops).
  void close_all();

 private:
  // Closes `ep`, logging why unless its refusal was logged.
  void refuse(ucp_ep_h ep, const std::string& why);

  struct Waiting {
    uint64_t ticket = 0;   // tells a later endpoint at the same address from the one a deadline was set for
    std::string who;       // the sender's address, for the log
    bool refused = false;  // its credential was refused: closed when the sender closes, or at the deadline
  };
  const std::shared_ptr<Engine> engine_;
  const AdmitCallback admit_;
  const uint64_t default_max_bucket_;
  std::map<ucp_ep_h, Waiting> waiting_;
  uint64_t tickets_ = 0;
};

}  // namespace ferry::transport::ucx

// Peers that connect to a listener without being senders: they present no credential, or part of
// one, or send something else first. A receiver must close each by kAdmissionDeadline, never
// taking anything from it.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "transport/transport.h"

namespace ferry::transport::testing {

enum class Stranger {
  kSilent,   // connects and sends nothing
  kPartial,  // a partial credential: the start of a frame that announces more (tcp, cuda_ipc, nccl,
             // shm); a bucket before any credential where a credential cannot be cut (ucx)
};

class StrangerPeer {
 public:
  virtual ~StrangerPeer() = default;
  // True once the receiver has closed the connection (as this end sees it); false at `deadline`.
  virtual bool closed_by(Deadline deadline) = 0;
};

// Connects a stranger to the listener `blob` of `transport`.
Result<std::unique_ptr<StrangerPeer>> connect_stranger(const std::string& transport, const std::string& blob,
                                                       Stranger kind);

// A raw TCP socket to the host and port of a "tcp://host:port" (or "nccl://host:port") blob; -1 on
// failure (with a test failure saying why).
int raw_tcp_socket(const std::string& blob);
// True once the peer closed `fd` (end of stream or reset); false at `deadline`.
bool peer_closed(int fd, Deadline deadline);

#if defined(FERRY_TEST_UCX)
Result<std::unique_ptr<StrangerPeer>> connect_ucx_stranger(const std::string& blob, Stranger kind);  // stranger_ucx.cc
#endif

}  // namespace ferry::transport::testing

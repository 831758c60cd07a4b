#include "tests/transport/stranger.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "transport/admission.h"
#include "transport/shm/shm_ring.h"

namespace ferry::transport::testing {
namespace {

// The first bytes of a frame that announces a 16-byte credential: 3 of them follow, then nothing.
std::string partial_frame() { return credential_frame(std::string(16, 'x')).substr(0, kCredentialHeaderBytes + 3); }

class SocketStranger final : public StrangerPeer {
 public:
  explicit SocketStranger(int fd) : fd_(fd) {}
  ~SocketStranger() override { close(fd_); }
  bool closed_by(Deadline deadline) override { return peer_closed(fd_, deadline); }

 private:
  int fd_;
};

// A cuda_ipc listener: "cuda_ipc://<boot id>/<abstract socket name>".
int raw_unix_socket(const std::string& blob) {
  const size_t slash = blob.find('/', std::string("cuda_ipc://").size());
  if (slash == std::string::npos) {
    ADD_FAILURE() << "not a cuda_ipc blob: " << blob;
    return -1;
  }
  const std::string name = blob.substr(slash + 1);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name.data(), n);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&a), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) != 0) {
    ADD_FAILURE() << "connect to @" << name << ": " << std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

// Claims an entry of an shm listener and never offers it (kPartial: with half a credential).
class ShmStranger final : public StrangerPeer {
 public:
  static Result<std::unique_ptr<StrangerPeer>> connect(const std::string& blob, Stranger kind) {
    const size_t slash = blob.find('/', std::string("shm://").size());
    if (slash == std::string::npos) return Status::invalid_argument("not an shm blob: " + blob);
    auto s = std::make_unique<ShmStranger>();
    FERRY_ASSIGN_OR_RETURN(s->listener_, shm::Segment::open(blob.substr(slash)));
    auto* lh = static_cast<shm::ListenerHeader*>(s->listener_.data());
    for (auto& e : lh->entries) {
      uint32_t free = shm::kFree;
      if (e.state.compare_exchange_strong(free, shm::kClaiming)) {
        s->entry_ = &e;
        break;
      }
    }
    if (s->entry_ == nullptr) return Status::resource_exhausted("no free shm entry");
    s->entry_->sender_pid = getpid();
    if (kind == Stranger::kPartial) {
      // Claims an entry and writes 3 of the 16 credential bytes it announces, then never offers
      // it: the receiver must take the entry back at the admission deadline.
      s->entry_->credential_bytes = 16;
      std::memcpy(s->entry_->credential, "xxx", 3);
    }
    return std::unique_ptr<StrangerPeer>(std::move(s));
  }
  // The receiver took the entry back.
  bool closed_by(Deadline deadline) override {
    while (Clock::now() < deadline) {
      if (entry_->state.load() != shm::kClaiming) return true;
      shm::futex_wait(entry_->state, shm::kClaiming, std::chrono::microseconds(10000));
    }
    return false;
  }

 private:
  shm::Segment listener_;
  shm::ListenerEntry* entry_ = nullptr;
};

}  // namespace

int raw_tcp_socket(const std::string& blob) {
  const size_t scheme = blob.find("://");
  const size_t colon = blob.rfind(':');
  if (scheme == std::string::npos || colon == std::string::npos || colon < scheme + 3) {
    ADD_FAILURE() << "not a host:port blob: " << blob;
    return -1;
  }
  std::string host = blob.substr(scheme + 3, colon - scheme - 3);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const std::string port = blob.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    ADD_FAILURE() << "resolve " << host;
    return -1;
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0) {
    ADD_FAILURE() << "connect to " << host << ":" << port << ": " << std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

bool peer_closed(int fd, Deadline deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char buf[256];
    const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
}

Result<std::unique_ptr<StrangerPeer>> connect_stranger(const std::string& transport, const std::string& blob,
                                                       Stranger kind) {
  if (transport == "shm") return ShmStranger::connect(blob, kind);
#if defined(FERRY_TEST_UCX)
  if (transport == "ucx") return connect_ucx_stranger(blob, kind);
#endif
  int fd = -1;
  if (transport == "tcp" || transport == "nccl") fd = raw_tcp_socket(blob);
  else if (transport == "cuda_ipc") fd = raw_unix_socket(blob);
  else return Status::invalid_argument("no stranger for transport " + transport);
  if (fd < 0) return Status::unavailable("could not connect a stranger to " + blob);
  if (kind == Stranger::kPartial) {
    const std::string bytes = partial_frame();
    if (send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
      close(fd);
      return Status::unavailable("stranger: send failed");
    }
  }
  return std::unique_ptr<StrangerPeer>(std::make_unique<SocketStranger>(fd));
}

}  // namespace ferry::transport::testing

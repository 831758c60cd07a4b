#include "transport/common/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include <fmt/format.h>

#include "core/log.h"

namespace ferry::transport::net {
namespace {

Status sys_error(std::string_view what) { return Status::unavailable(fmt::format("{}: {}", what, std::strerror(errno))); }

int ms_left(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

// Waits for `events` on `fd`; DeadlineExceeded at the deadline.
Status wait_fd(int fd, short events, Deadline deadline, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, ms_left(deadline));
    if (r > 0) return ok_status();
    if (r < 0 && errno != EINTR) return sys_error(what);
    if (r == 0 && Clock::now() >= deadline) return Status::deadline_exceeded(fmt::format("{}: deadline passed", what));
  }
}

sockaddr_un abstract_addr(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] == 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

Status finish_connect(int fd, Deadline deadline, const std::string& to) {
  FERRY_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, "connect to " + to));
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return sys_error("getsockopt");
  if (err != 0) return Status::unavailable(fmt::format("connect to {}: {}", to, std::strerror(err)));
  return ok_status();
}

}  // namespace

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Result<Socket> Socket::connect_unix(const std::string& name, Deadline deadline) {
  Socket s(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s.valid()) return sys_error("socket");
  socklen_t len = 0;
  const sockaddr_un a = abstract_addr(name, &len);
  for (;;) {
    if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&a), len) == 0) return s;
    // A full backlog says EAGAIN on Unix sockets: the listener is alive but busy.
    if (errno == EAGAIN || errno == EINTR) {
      if (Clock::now() >= deadline) return Status::deadline_exceeded("connect to @" + name + ": backlog stayed full");
      usleep(1000);
      continue;
    }
    if (errno == EINPROGRESS) {
      FERRY_RETURN_IF_ERROR(finish_connect(s.fd(), deadline, "@" + name));
      return s;
    }
    return sys_error("connect to @" + name + " (is the receiver alive, on this node and in this network namespace?)");
  }
}

Result<Socket> Socket::connect_tcp(const std::string& host, const std::string& port, Deadline deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) return Status::unavailable(fmt::format("resolve {}: {}", host, gai_strerror(rc)));
  Status last = Status::unavailable("resolve " + host + ": no address");
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Socket s(socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      last = sys_error("socket");
      continue;
    }
    const int one = 1;
    setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (::connect(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = sys_error(fmt::format("connect to {}:{}", host, port));
        continue;
      }
      last = finish_connect(s.fd(), deadline, host + ":" + port);
      if (!last.ok()) continue;
    }
    freeaddrinfo(res);
    return s;
  }
  freeaddrinfo(res);
  return last;
}

Status Socket::write_all(const void* data, size_t size, Deadline deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      FERRY_RETURN_IF_ERROR(wait_fd(fd_, POLLOUT, deadline, "control channel send"));
    } else {
      return sys_error("control channel send (peer closed or died)");
    }
  }
  return ok_status();
}

Status Socket::read_all(void* data, size_t size, Deadline deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::recv(fd_, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
    } else if (n == 0) {
      return Status::unavailable("control channel: the peer closed the connection (exited or died)");
    } else if (errno == EAGAIN || errno == EINTR) {
      FERRY_RETURN_IF_ERROR(wait_fd(fd_, POLLIN, deadline, "control channel receive"));
    } else {
      return sys_error("control channel receive");
    }
  }
  return ok_status();
}

Result<bool> Socket::read_available(std::string& buf) {
  char tmp[16 << 10];
  for (;;) {
    const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
    if (n > 0) {
      buf.append(tmp, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) return false;
    return sys_error("control channel receive");
  }
}

Result<Listener> Listener::unix_abstract(const std::string& name) {
  Listener l;
  l.sock_ = Socket(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!l.sock_.valid()) return sys_error("socket");
  socklen_t len = 0;
  const sockaddr_un a = abstract_addr(name, &len);
  if (bind(l.sock_.fd(), reinterpret_cast<const sockaddr*>(&a), len) != 0) return sys_error("bind @" + name);
  if (::listen(l.sock_.fd(), 64) != 0) return sys_error("listen @" + name);
  return l;
}

Result<Listener> Listener::tcp(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), "0", &hints, &res);
  if (rc != 0) return Status::invalid_argument(fmt::format("listen host '{}': {}", host, gai_strerror(rc)));
  Listener l;
  l.sock_ = Socket(socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const int one = 1;
  Status st;
  if (!l.sock_.valid()) st = sys_error("socket");
  if (st.ok()) setsockopt(l.sock_.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (st.ok() && bind(l.sock_.fd(), res->ai_addr, res->ai_addrlen) != 0) st = sys_error("bind " + host);
  freeaddrinfo(res);
  FERRY_RETURN_IF_ERROR(st);
  if (::listen(l.sock_.fd(), 64) != 0) return sys_error("listen " + host);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getsockname(l.sock_.fd(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return sys_error("getsockname");
  l.port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return l;
}

Socket Listener::accept() {
  if (Clock::now() < retry_at_) return Socket();
  for (;;) {
    const int fd = accept4(sock_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      backoff_ = std::chrono::milliseconds(1);
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // fails harmlessly on Unix sockets
      return Socket(fd);
    }
    const int e = errno;
    if (e == EINTR || e == ECONNABORTED) continue;  // that connection is gone; the next may wait
    if (e == EAGAIN || e == EWOULDBLOCK) return Socket();
    const uint64_t bit = e < 64 ? uint64_t{1} << e : 0;
    if (bit == 0 || (logged_ & bit) == 0) {
      logged_ |= bit;
      FERRY_LOG_WARN("accept on a control listener failed ({}); retrying with back-off, connections wait in the backlog",
                     std::strerror(e));
    }
    retry_at_ = Clock::now() + backoff_;
    backoff_ = std::min(backoff_ * 2, std::chrono::milliseconds(100));
    return Socket();
  }
}

int Listener::poll_fd() const { return Clock::now() < retry_at_ ? -1 : sock_.fd(); }

int Listener::timeout_ms(int cap) const {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(retry_at_ - Clock::now()).count() + 1;
  return left > 0 ? static_cast<int>(std::min<int64_t>(left, cap)) : cap;
}

Waker::Waker() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
Waker::~Waker() {
  if (fd_ >= 0) ::close(fd_);
}
void Waker::notify() {
  const uint64_t one = 1;
  if (::write(fd_, &one, sizeof one) < 0) {
    // The counter is saturated: the loop is already due to wake.
  }
}
void Waker::drain() {
  uint64_t v = 0;
  if (::read(fd_, &v, sizeof v) < 0) {
    // Nothing pending.
  }
}

uint64_t wait_readable(const int* fds, size_t n, int timeout_ms) {
  pollfd p[64];
  n = std::min<size_t>(n, 64);
  for (size_t i = 0; i < n; ++i) p[i] = pollfd{fds[i], POLLIN, 0};
  const int r = poll(p, static_cast<nfds_t>(n), timeout_ms);
  uint64_t mask = 0;
  if (r <= 0) return 0;
  for (size_t i = 0; i < n; ++i) {
    if (p[i].revents != 0) mask |= uint64_t{1} << i;
  }
  return mask;
}

bool pop_msg(std::string& buf, Msg* out) {
  if (buf.size() < sizeof(Msg)) return false;
  std::memcpy(out, buf.data(), sizeof(Msg));
  out->text[sizeof out->text - 1] = '\0';
  buf.erase(0, sizeof(Msg));
  return true;
}

Msg text_msg(uint32_t type, const std::string& text) {
  Msg m;
  m.type = type;
  std::snprintf(m.text, sizeof m.text, "%s", text.c_str());
  return m;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id.empty() ? "unknown-boot" : id;
}

uint64_t process_nonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  }();
  return nonce;
}

}  // namespace ferry::transport::net

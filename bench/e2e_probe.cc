#include "bench/e2e_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

extern char** environ;

namespace ferry::e2e {
namespace {

int ms_left(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

Status errno_status(const char* what) { return Status::unavailable(fmt::format("probe {}: {}", what, std::strerror(errno))); }

sockaddr_in loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

}  // namespace

ProbeSocket::~ProbeSocket() {
  if (fd_ >= 0) close(fd_);
}

ProbeSocket& ProbeSocket::operator=(ProbeSocket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Result<ProbeSocket> ProbeSocket::connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno_status("socket");
  ProbeSocket s(fd);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const sockaddr_in a = loopback(port);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) return errno_status("connect");
  return s;
}

Status ProbeSocket::write_all(const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::send(fd_, p + done, n - done, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return errno_status("send");
    done += static_cast<size_t>(w);
  }
  return ok_status();
}

Status ProbeSocket::send(std::string_view frame) {
  std::string out(4, '\0');
  const auto n = static_cast<uint32_t>(frame.size());
  std::memcpy(out.data(), &n, 4);
  out.append(frame);
  return write_all(out.data(), out.size());
}

Status ProbeSocket::read_all(void* out, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < n) {
    pollfd pf{fd_, POLLIN, 0};
    const int r = poll(&pf, 1, ms_left(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno_status("poll");
    if (r == 0) return Status::deadline_exceeded("probe: no answer from the other process before the deadline");
    const ssize_t got = ::recv(fd_, p + done, n - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got == 0) return Status::unavailable("probe: the other process closed the connection");
    if (got < 0) return errno_status("recv");
    done += static_cast<size_t>(got);
  }
  return ok_status();
}

Status ProbeSocket::send_parts(const std::vector<std::string_view>& parts) {
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  if (total > (1u << 30)) return Status::invalid_argument(fmt::format("probe: frame of {} bytes, over 1 GiB", total));
  const auto n = static_cast<uint32_t>(total);
  FERRY_RETURN_IF_ERROR(write_all(&n, 4));
  for (const std::string_view part : parts) FERRY_RETURN_IF_ERROR(write_all(part.data(), part.size()));
  return ok_status();
}

Status ProbeSocket::recv_parts(const std::vector<std::pair<void*, size_t>>& parts, Clock::time_point deadline) {
  uint32_t n = 0;
  FERRY_RETURN_IF_ERROR(read_all(&n, 4, deadline));
  size_t total = 0;
  for (const auto& p : parts) total += p.second;
  if (n != total) return Status::data_loss(fmt::format("probe: a frame of {} bytes where {} were expected", n, total));
  for (const auto& [at, size] : parts) FERRY_RETURN_IF_ERROR(read_all(at, size, deadline));
  return ok_status();
}

Result<std::string> ProbeSocket::recv(Clock::time_point deadline) {
  uint32_t n = 0;
  FERRY_RETURN_IF_ERROR(read_all(&n, 4, deadline));
  // Up to a gathering trainer rank's rows of the larger bench model (half of its 234 MB, and more).
  if (n > (1u << 30)) return Status::data_loss(fmt::format("probe: frame of {} bytes, over 1 GiB", n));
  std::string frame(n, '\0');
  FERRY_RETURN_IF_ERROR(read_all(frame.data(), n, deadline));
  return frame;
}

ProbeListener::~ProbeListener() {
  if (fd_ >= 0) close(fd_);
}

Status ProbeListener::open() {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return errno_status("socket");
  sockaddr_in a = loopback(0);
  if (bind(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) return errno_status("bind");
  if (listen(fd_, 64) != 0) return errno_status("listen");
  socklen_t len = sizeof a;
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return errno_status("getsockname");
  port_ = ntohs(a.sin_port);
  return ok_status();
}

Result<ProbeSocket> ProbeListener::accept(Clock::time_point deadline) {
  pollfd pf{fd_, POLLIN, 0};
  int r;
  do {
    r = poll(&pf, 1, ms_left(deadline));
  } while (r < 0 && errno == EINTR);
  if (r < 0) return errno_status("poll");
  if (r == 0) return Status::deadline_exceeded("probe: a rank process did not connect before the deadline");
  const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return errno_status("accept");
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return ProbeSocket(fd);
}

std::string_view command_of(std::string_view frame, std::string_view* rest) {
  const size_t sp = frame.find(' ');
  if (rest) *rest = sp == std::string_view::npos ? std::string_view() : frame.substr(sp + 1);
  return frame.substr(0, sp);
}

Status Child::spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) != 0) {
    return Status::unavailable(std::string("posix_spawn: ") + std::strerror(errno));
  }
  pid_ = pid;
  pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid_, 0));
  return ok_status();
}

int Child::reap(int ms) {
  if (pid_ <= 0) return 0;
  if (pidfd_ >= 0) {
    pollfd p{pidfd_, POLLIN, 0};
    if (poll(&p, 1, ms) == 0) kill(pid_, SIGKILL);
  }
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Child::~Child() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    reap(10'000);
  }
  if (pidfd_ >= 0) close(pidfd_);
}

}  // namespace ferry::e2e

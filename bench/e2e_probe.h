// The command link between `ferry bench e2e` and the rank processes it starts: one loopback TCP
// connection per rank, carrying frames of (u32 length, bytes) whose first word names the command.
// It only orders the bench's phases (measure links, then join the coordinator); the update itself
// runs over ferry's control plane and the transport under test.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ferry::e2e {

using Clock = std::chrono::steady_clock;

class ProbeSocket {
 public:
  ProbeSocket() = default;
  explicit ProbeSocket(int fd) : fd_(fd) {}
  ~ProbeSocket();
  ProbeSocket(ProbeSocket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  ProbeSocket& operator=(ProbeSocket&& o) noexcept;
  ProbeSocket(const ProbeSocket&) = delete;
  ProbeSocket& operator=(const ProbeSocket&) = delete;

  // Connects to 127.0.0.1:port (the bench listens before it starts the ranks: a loopback connect
  // succeeds or fails at once).
  static Result<ProbeSocket> connect(uint16_t port);

  Status send(std::string_view frame);
  // The next frame; DeadlineExceeded past `deadline`, Unavailable when the peer closed.
  Result<std::string> recv(Clock::time_point deadline);
  // One frame of `parts` in order, written from where they lie (a gathering trainer rank's rows).
  Status send_parts(const std::vector<std::string_view>& parts);
  // The next frame, read in place into `parts` in order; DataLoss unless it is exactly their size.
  Status recv_parts(const std::vector<std::pair<void*, size_t>>& parts, Clock::time_point deadline);
  bool ok() const { return fd_ >= 0; }

 private:
  Status read_all(void* out, size_t n, Clock::time_point deadline);
  Status write_all(const void* data, size_t n);
  int fd_ = -1;
};

// A listening socket on 127.0.0.1, any port.
class ProbeListener {
 public:
  ProbeListener() = default;
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;

  Status open();
  uint16_t port() const { return port_; }
  Result<ProbeSocket> accept(Clock::time_point deadline);

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

// A bench process: this binary re-run with `args` (args[0] is its name); killed if it has not
// exited by the time this goes away.
class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  Child(Child&& o) noexcept : pid_(o.pid_), pidfd_(o.pidfd_) { o.pid_ = o.pidfd_ = -1; }
  ~Child();
  Status spawn(const std::vector<std::string>& args);
  // Exit status (128 + signal when killed); kills the process past `ms`.
  int reap(int ms);
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  int pidfd_ = -1;
};

// "word rest" -> word; rest into `*rest` when given.
std::string_view command_of(std::string_view frame, std::string_view* rest = nullptr);

}  // namespace ferry::e2e

// Deadline-bounded stream sockets for the control channels of the device transports: a Unix socket
// in the abstract namespace (cuda_ipc, one node) or TCP (nccl). Every socket is non-blocking; a
// peer that dies closes its end, which the other side reads as end of stream, so a dead peer
// becomes a Status instead of a hang. Writes never raise SIGPIPE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/status.h"
#include "transport/transport.h"

namespace ferry::transport::net {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  static Result<Socket> connect_unix(const std::string& abstract_name, Deadline deadline);
  static Result<Socket> connect_tcp(const std::string& host, const std::string& port, Deadline deadline);

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  Status write_all(const void* data, size_t size, Deadline deadline);
  // Unavailable at end of stream (the peer closed or died), DeadlineExceeded at the deadline.
  Status read_all(void* data, size_t size, Deadline deadline);
  // Appends whatever is readable now, without blocking; false once the peer has closed.
  Result<bool> read_available(std::string& buf);
  void close();

 private:
  int fd_ = -1;
};

// A listening socket whose accept() survives its errors (cuda_ipc's and nccl's receiving threads
// poll it between their other work).
class Listener {
 public:
  Listener() = default;
  Listener(Listener&& o) noexcept = default;
  Listener& operator=(Listener&& o) noexcept = default;

  static Result<Listener> unix_abstract(const std::string& name);
  // Binds `host` on a free port.
  static Result<Listener> tcp(const std::string& host);
  int fd() const { return sock_.fd(); }
  int port() const { return port_; }
  // A pending connection, or an invalid Socket when none is waiting or accept() is backing off.
  // Any error (EMFILE, ENFILE, ENOBUFS, ENOMEM, ...) is logged once per kind and accepting pauses
  // for a back-off that doubles from 1 ms to 100 ms while it persists: descriptors free up as
  // connections close, and a listener out of them neither ends nor spins.
  Socket accept();
  // What a poll loop watches for new connections: -1 (ignored by poll()) while backing off.
  int poll_fd() const;
  // `cap`, or less when the back-off ends sooner (ms).
  int timeout_ms(int cap) const;

 private:
  Socket sock_;
  int port_ = 0;
  Deadline retry_at_{};                        // accept() waits until then after an error
  std::chrono::milliseconds backoff_{1};
  uint64_t logged_ = 0;                         // errno values already logged (those under 64)
};

// Wakes a poll() loop from another thread (an eventfd).
class Waker {
 public:
  Waker();
  ~Waker();
  Waker(const Waker&) = delete;
  Waker& operator=(const Waker&) = delete;
  int fd() const { return fd_; }
  void notify();
  void drain();

 private:
  int fd_ = -1;
};

// Blocks until one of `fds` is readable (or hung up), or `timeout_ms` passes (0: just look).
// Returns the readable mask, one bit per fd (at most 64 fds).
uint64_t wait_readable(const int* fds, size_t n, int timeout_ms);

// Fixed-size control message; `text` carries a NUL-terminated reason where one is needed.
struct Msg {
  uint32_t type = 0;
  uint32_t slot = 0;
  uint64_t total = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  char text[96] = {};
};
static_assert(sizeof(Msg) == 128);

// Takes one whole Msg off the front of `buf`; false when fewer than sizeof(Msg) bytes are there.
bool pop_msg(std::string& buf, Msg* out);
Msg text_msg(uint32_t type, const std::string& text);

// This machine's boot id, so a blob used on another node fails clearly.
std::string boot_id();
// A random 64-bit value fixed for the life of this process: two ends with the same nonce share an
// address space (pids repeat across containers; this does not).
uint64_t process_nonce();

}  // namespace ferry::transport::net

// A plain TCP client for feeding a coordinator bytes no well-behaved member would send.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "coordinator/channel.h"

namespace ferry::testutil {

class RawSocket {
 public:
  explicit RawSocket(const std::string& address) {
    const size_t colon = address.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  bool write(const std::string& bytes) { return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()); }
  // Reads one frame; false on EOF, error or `timeout_ms` without data.
  bool read_frame(wire::Envelope* env, int timeout_ms = 5000) {
    std::string hdr(4, '\0');
    if (!read_exact(hdr.data(), 4, timeout_ms)) return false;
    uint32_t n = 0;
    for (int i = 3; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(hdr[static_cast<size_t>(i)]);
    std::string body(n, '\0');
    return read_exact(body.data(), n, timeout_ms) && env->ParseFromString(body);
  }
  // True when the peer closed the connection within `timeout_ms` (after any frames it sent).
  bool closed_by_peer(int timeout_ms = 5000) {
    char c;
    while (true) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) return false;
      const ssize_t r = ::recv(fd_, &c, 1, 0);
      if (r <= 0) return true;
    }
  }

 private:
  bool read_exact(char* p, size_t n, int timeout_ms) {
    while (n) {
      pollfd pf{fd_, POLLIN, 0};
      if (poll(&pf, 1, timeout_ms) <= 0) return false;
      const ssize_t r = ::recv(fd_, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  int fd_ = -1;
};

inline std::string frame_header(uint32_t n) {
  std::string h(4, '\0');
  for (int i = 0; i < 4; ++i) h[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return h;
}

}  // namespace ferry::testutil

#include "transport/common/socket_admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "transport/admission.h"

namespace ferry::transport::net {
namespace {

// Who is at the other end, for the log: a Unix socket's peer pid, a TCP peer's address.
std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "an unknown peer";
  if (ss.ss_family == AF_UNIX) {
    ucred cred{};
    socklen_t n = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &n) == 0) return fmt::format("pid {}", cred.pid);
    return "a local peer";
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
    return fmt::format("{}:{}", text, ntohs(a->sin_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
  return fmt::format("[{}]:{}", text, ntohs(a->sin6_port));
}

}  // namespace

void Admissions::add(Socket s) {
  Pending p;
  p.who = peer_name(s.fd());
  p.sock = std::move(s);
  p.deadline = Clock::now() + kAdmissionDeadline;
  p.want = kCredentialHeaderBytes;
  pending_.push_back(std::move(p));
}

bool Admissions::step(Pending& p, const std::function<void(Socket, const Admission&)>& on_admitted, bool* progress) {
  char buf[kCredentialHeaderBytes + kMaxCredentialBytes];
  const size_t n = p.want - p.frame.size();  // never past the frame: what follows is the handshake's
  const ssize_t got = ::recv(p.sock.fd(), buf, n, 0);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    if (Clock::now() < p.deadline) return false;
    log_unadmitted(transport_, p.who, fmt::format("no credential within {} ms", kAdmissionDeadline.count()));
    return true;
  }
  *progress = true;
  if (got <= 0) {
    log_unadmitted(transport_, p.who,
                   got == 0 ? "closed before presenting a credential" : std::string(std::strerror(errno)));
    return true;
  }
  p.frame.append(buf, static_cast<size_t>(got));
  if (p.frame.size() < p.want) return false;
  if (p.want == kCredentialHeaderBytes) {
    std::array<uint8_t, kCredentialHeaderBytes> header;
    std::memcpy(header.data(), p.frame.data(), header.size());
    auto length = credential_length(header);
    if (!length.ok()) {
      log_unadmitted(transport_, p.who, length.status().message());
      return true;
    }
    p.want += *length;
    if (*length > 0) return false;
  }
  auto granted = admit_peer(admit_, std::string_view(p.frame).substr(kCredentialHeaderBytes), transport_, p.who,
                            default_max_bucket_);
  if (granted.ok()) on_admitted(std::move(p.sock), *granted);
  return true;
}

void Admissions::poll(const std::function<void(Socket, const Admission&)>& on_admitted, bool* progress) {
  for (size_t i = 0; i < pending_.size();) {
    bool done = false;
    // Whatever is readable now, frame by frame stage.
    for (size_t before = pending_[i].frame.size();;) {
      done = step(pending_[i], on_admitted, progress);
      if (done || pending_[i].frame.size() == before) break;
      before = pending_[i].frame.size();
    }
    if (done) {
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      *progress = true;
    } else {
      ++i;
    }
  }
}

void Admissions::append_fds(std::vector<int>& fds) const {
  for (const auto& p : pending_) fds.push_back(p.sock.fd());
}

int Admissions::timeout_ms(int cap) const {
  int out = cap;
  const auto now = Clock::now();
  for (const auto& p : pending_) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count() + 1;
    out = std::min<int>(out, static_cast<int>(std::clamp<int64_t>(left, 0, cap)));
  }
  return out;
}

}  // namespace ferry::transport::net

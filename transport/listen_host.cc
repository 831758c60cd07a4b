#include "transport/listen_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include <fmt/format.h>


namespace ferry::transport {

Result<std::string> interface_of(const std::string& host) {
  in_addr v4{};
  in6_addr v6{};
  const bool is_v4 = inet_pton(AF_INET, host.c_str(), &v4) == 1;
  if (!is_v4 && inet_pton(AF_INET6, host.c_str(), &v6) != 1) {
    return Status::invalid_argument(fmt::format("FERRY_LISTEN_HOST='{}' is not an address", host));
  }
  if (is_v4 ? v4.s_addr == htonl(INADDR_ANY) : IN6_IS_ADDR_UNSPECIFIED(&v6)) return std::string();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return Status::internal(fmt::format("getifaddrs: {}", std::strerror(errno)));
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (is_v4 && a->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == v4.s_addr) {
      found = a->ifa_name;
    } else if (!is_v4 && a->ifa_addr->sa_family == AF_INET6 &&
               std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, &v6, sizeof v6) == 0) {
      found = a->ifa_name;
    }
  }
  freeifaddrs(list);
  if (found.empty()) return Status::not_found(fmt::format("no network interface of this machine holds {}", host));
  return found;
}

bool peer_on_this_host(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof local, peer_len = sizeof peer;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  if (peer.ss_family == AF_UNIX) return true;
  if (peer.ss_family == AF_INET && local.ss_family == AF_INET) {
    const in_addr p = reinterpret_cast<const sockaddr_in*>(&peer)->sin_addr;
    const in_addr l = reinterpret_cast<const sockaddr_in*>(&local)->sin_addr;
    return (ntohl(p.s_addr) >> 24) == 127 || p.s_addr == l.s_addr;
  }
  if (peer.ss_family == AF_INET6 && local.ss_family == AF_INET6) {
    const in6_addr& p = reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_addr;
    const in6_addr& l = reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr;
    const bool mapped_loopback = IN6_IS_ADDR_V4MAPPED(&p) && p.s6_addr[12] == 127;
    return IN6_IS_ADDR_LOOPBACK(&p) || mapped_loopback || std::memcmp(&p, &l, sizeof p) == 0;
  }
  return false;
}

}  // namespace ferry::transport

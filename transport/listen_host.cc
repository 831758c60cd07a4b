#include "transport/listen_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

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

}  // namespace ferry::transport

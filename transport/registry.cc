// The registry: every backend built into this ferry, in priority order. Each backend's folder
// registers itself (ferry_transport_backend() in its CMakeLists.txt); the generated header
// includes their factories' headers and lists them.
#include <fmt/format.h>

#include "transport/registered_backends.h"
#include "transport/transport.h"

namespace ferry::transport {

const std::vector<TransportFactory>& transport_factories() {
  // cuda_ipc and nccl hand the receiver DEVICE memory, so they register MANUAL: "auto" never
  // picks them, they are used only when named (FERRY_TRANSPORT).
  static const std::vector<TransportFactory> factories = {FERRY_REGISTERED_TRANSPORTS};
  return factories;
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name, const TransportOptions& options) {
  Status last = Status::unavailable("no transport could be created");
  for (const auto& f : transport_factories()) {
    if (name == "auto" ? !f.automatic : f.name != name) continue;
    auto t = f.create(options);
    if (t.ok()) return t;
    last = t.status().with_context(std::string(f.name));
    if (name != "auto") return last;
  }
  if (name != "auto") {
    return Status::unavailable(fmt::format("transport '{}' is not built into this ferry", name));
  }
  return last;
}

}  // namespace ferry::transport

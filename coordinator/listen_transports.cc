#include "coordinator/listen_transports.h"

namespace ferry::coordinator {

Result<std::vector<std::unique_ptr<transport::Transport>>> create_listen_transports(const Settings& settings) {
  const std::string& forced = settings.transport;
  const transport::TransportOptions options = transport::transport_options(settings);
  std::vector<std::unique_ptr<transport::Transport>> out;
  if (forced != "auto") {
    FERRY_ASSIGN_OR_RETURN(auto t, transport::create_transport(forced, options));
    out.push_back(std::move(t));
    return out;
  }
  Status last = Status::unavailable("no transport could be created");
  for (const auto& f : transport::transport_factories()) {
    if (!f.automatic) continue;
    auto t = f.create(options);
    if (t.ok()) {
      out.push_back(std::move(*t));
    } else {
      last = t.status().with_context(std::string(f.name));
    }
  }
  if (out.empty()) return last;
  return out;
}

}  // namespace ferry::coordinator

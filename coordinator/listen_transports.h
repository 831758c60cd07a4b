// Which transports a rollout rank listens on.
#pragma once

#include <memory>
#include <vector>

#include "transport/transport.h"

namespace ferry::coordinator {

// With settings.transport (FERRY_TRANSPORT) auto every automatic transport that can be created here,
// in priority order (a sender picks the first that reaches the rank); otherwise the one it names.
Result<std::vector<std::unique_ptr<transport::Transport>>> create_listen_transports(const Settings& settings);

}  // namespace ferry::coordinator

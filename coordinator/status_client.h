// Asks a coordinator for its members, their versions and states, and its recent updates.
#pragma once

#include <string>

#include "core/settings.h"
#include "core/status.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

// Joins as an observer with `settings`' token and frame limit.
Result<wire::StatusReply> query_status(const std::string& address, int64_t timeout_ms, const Settings& settings);

}  // namespace ferry::coordinator

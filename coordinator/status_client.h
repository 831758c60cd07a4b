// Asks a coordinator for its members, their versions and states, and its recent updates.
#pragma once

#include <string>

#include "core/status.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

Result<wire::StatusReply> query_status(const std::string& address, int64_t timeout_ms);

}  // namespace ferry::coordinator

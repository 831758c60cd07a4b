// UCX's own log records go through ferry's logger (stderr, or the sink a user installed), not to
// stdout: UCX prints to stdout unless UCX_LOG_FILE says otherwise, and stdout is where ferry's
// commands print their results (`ferry bench ... --json` lines, which a reader parses one per line).
#pragma once

namespace ferry::transport::ucx {

// Installs, once per process, a UCX log handler that hands each record UCX lets through (its own
// UCX_LOG_LEVEL still applies) to ferry's logger at the matching level. A user's UCX_LOG_FILE is
// left to UCX. Safe from any thread.
void route_ucx_log();

}  // namespace ferry::transport::ucx

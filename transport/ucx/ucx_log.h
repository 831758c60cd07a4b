// UCX's own log records go through ferry's logger (stderr, or the sink a user installed), not to
// stdout: UCX prints to stdout unless UCX_LOG_FILE says otherwise, and stdout is where ferry's
// commands print their results (`ferry bench ... --json` lines, which a reader parses one per line).
#pragma once

namespace ferry::transport::ucx {

// Installs, once per process, a UCX log handler that hands each record UCX lets through to ferry's
// logger at the matching level. Both levels apply: UCX_LOG_LEVEL (and UCX_LOG_FILE_FILTER) decide
// what UCX logs, FERRY_LOG_LEVEL what ferry shows of it (UCX_LOG_LEVEL=debug needs
// FERRY_LOG_LEVEL=debug too). A log file the user gave UCX stays UCX's, and so does a record at
// UCX_LOG_LEVEL_TRIGGER (UCX's default handler ends the process on it); what UCX logs while it loads,
// before any handler can be installed (at debug levels only), goes where UCX_LOG_FILE says. Safe from
// any thread.
void route_ucx_log();

}  // namespace ferry::transport::ucx

#include "transport/ucx/ucx_log.h"

#include <fnmatch.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include "core/log.h"

namespace ferry::transport::ucx {
namespace {

// Set at exit, before ferry's logger is destroyed (it was made before the hook was registered, so
// its destructor runs after): UCX may still log from its async thread or its own destructors.
std::atomic<bool> logger_gone{false};

spdlog::level::level_enum ferry_level(ucs_log_level_t level) {
  switch (level) {
    case UCS_LOG_LEVEL_FATAL: return spdlog::level::critical;
    case UCS_LOG_LEVEL_ERROR: return spdlog::level::err;
    case UCS_LOG_LEVEL_WARN:
    case UCS_LOG_LEVEL_PRINT:  // ucs_print: output a user turned on (UCX_LOG_PRINT_ENABLE)
      return spdlog::level::warn;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO: return spdlog::level::info;
    case UCS_LOG_LEVEL_DEBUG: return spdlog::level::debug;
    default: return spdlog::level::trace;
  }
}

ucs_log_func_rc_t to_ferry(const char* file, unsigned line, const char*, ucs_log_level_t level,
                           const ucs_log_component_config_t* comp, const char* format, va_list ap) {
  // A record at or above UCX_LOG_LEVEL_TRIGGER is UCX's to handle: its default handler prints it and
  // ends the process (the trigger is fatal by default).
  if (level <= ucs_global_opts.log_level_trigger) return UCS_LOG_FUNC_RC_CONTINUE;
  // As UCX's default handler does: a record below its component's level, or from a file outside
  // its UCX_LOG_FILE_FILTER, is dropped; ucs_print's are not.
  if (!ucs_log_component_is_enabled(level, comp) && level != UCS_LOG_LEVEL_PRINT) return UCS_LOG_FUNC_RC_STOP;
  const char* slash = std::strrchr(file, '/');
  const char* base = slash != nullptr ? slash + 1 : file;
  if (comp->file_filter != nullptr && fnmatch(comp->file_filter, base, 0) != 0) return UCS_LOG_FUNC_RC_STOP;
  const spdlog::level::level_enum to = ferry_level(level);
  const bool gone = logger_gone.load(std::memory_order_acquire);
  if (!gone && !logger().should_log(to)) return UCS_LOG_FUNC_RC_STOP;  // not even formatted
  std::string message(std::max<size_t>(ucs_log_get_buffer_size(), 256), '\0');
  va_list copy;
  va_copy(copy, ap);
  const int n = std::vsnprintf(message.data(), message.size(), format, copy);
  va_end(copy);
  message.resize(n < 0 ? 0 : std::min(message.size() - 1, static_cast<size_t>(n)));
  if (gone) {
    std::fprintf(stderr, "[ucx] %s:%u %s\n", base, line, message.c_str());
  } else {
    logger().log(to, "ucx: {}:{} {}", base, line, message);
  }
  return UCS_LOG_FUNC_RC_STOP;  // not UCX's default handler as well: it prints to stdout
}

}  // namespace

void route_ucx_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A log file the user gave UCX (UCX_LOG_FILE, or its configuration file) stays UCX's.
    if (ucs_global_opts.log_file != nullptr && ucs_global_opts.log_file[0] != '\0') return;
    logger();  // made now, so that it is destroyed after the hook below has run
    std::atexit([] { logger_gone.store(true, std::memory_order_release); });
    ucs_log_push_handler(&to_ferry);
  });
}

}  // namespace ferry::transport::ucx

#include "transport/ucx/ucx_log.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <ucs/debug/log_def.h>

#include "core/log.h"

namespace ferry::transport::ucx {
namespace {

spdlog::level::level_enum ferry_level(ucs_log_level_t level) {
  switch (level) {
    case UCS_LOG_LEVEL_FATAL:
    case UCS_LOG_LEVEL_ERROR: return spdlog::level::err;
    case UCS_LOG_LEVEL_WARN: return spdlog::level::warn;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO:
    case UCS_LOG_LEVEL_PRINT: return spdlog::level::info;
    case UCS_LOG_LEVEL_DEBUG: return spdlog::level::debug;
    default: return spdlog::level::trace;
  }
}

ucs_log_func_rc_t to_ferry(const char* file, unsigned line, const char*, ucs_log_level_t level,
                           const ucs_log_component_config_t* comp, const char* format, va_list ap) {
  // As UCX's default handler does: a record below its component's level is dropped, ucs_print's
  // are not.
  if (!ucs_log_component_is_enabled(level, comp) && level != UCS_LOG_LEVEL_PRINT) return UCS_LOG_FUNC_RC_STOP;
  char message[1024];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(message, sizeof message, format, copy);
  va_end(copy);
  const char* base = std::strrchr(file, '/');
  logger().log(ferry_level(level), "ucx: {}:{} {}", base != nullptr ? base + 1 : file, line, message);
  return UCS_LOG_FUNC_RC_STOP;  // not UCX's default handler as well: it prints to stdout
}

}  // namespace

void route_ucx_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("UCX_LOG_FILE") == nullptr) ucs_log_push_handler(&to_ferry);
  });
}

}  // namespace ferry::transport::ucx

// Logging through spdlog. The level is warn until a snapshot of the settings that sets FERRY_LOG_LEVEL
// (trace, debug, info, warn, error, off) is applied (apply_process_settings(), core/settings.h).
#pragma once

#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

namespace ferry {

// The process-wide ferry logger (stderr, "[ferry] [level] message"); created on first use.
spdlog::logger& logger();
// Sets a prefix that identifies this process in every line, e.g. "rank 1".
void set_log_identity(const std::string& identity);
// Sets the level by its name (trace, debug, info, warn, error, off).
void set_log_level(std::string_view level);

}  // namespace ferry

#define FERRY_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_INFO(...) SPDLOG_LOGGER_INFO(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_WARN(...) SPDLOG_LOGGER_WARN(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_ERROR(...) SPDLOG_LOGGER_ERROR(&::ferry::logger(), __VA_ARGS__)

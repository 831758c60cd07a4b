// Logging through spdlog. The level is warn until a snapshot of the settings that sets FERRY_LOG_LEVEL
// (trace, debug, info, warn, error, off) is applied (apply_process_settings(), core/settings.h).
#pragma once

#include <functional>
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

// Receives each record the logger lets through (its level still applies) instead of stderr: the
// level and the message, prefixed "<identity>: " when set_log_identity() set one. It is called on
// the thread that logged, possibly with ferry's locks held, so it must not block or log itself
// (the Python module queues the record and hands it to `logging` from a thread of its own).
using LogSink = std::function<void(spdlog::level::level_enum level, std::string_view message)>;
// Installs `sink`, or goes back to stderr when it is empty. Safe while other threads log; a record
// being written while the sink changes goes to the old one.
void set_log_sink(LogSink sink);

}  // namespace ferry

#define FERRY_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_INFO(...) SPDLOG_LOGGER_INFO(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_WARN(...) SPDLOG_LOGGER_WARN(&::ferry::logger(), __VA_ARGS__)
#define FERRY_LOG_ERROR(...) SPDLOG_LOGGER_ERROR(&::ferry::logger(), __VA_ARGS__)

#include "core/log.h"

#include <mutex>

#include <spdlog/sinks/stdout_sinks.h>

namespace ferry {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("ferry", sink);
  lg->set_pattern("[ferry] [%l] %v");
  lg->set_level(spdlog::level::warn);  // FERRY_LOG_LEVEL's default
  return lg;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> lg = make_logger();
  return *lg;
}

void set_log_identity(const std::string& identity) {
  logger().set_pattern("[ferry " + identity + "] [%l] %v");
}

void set_log_level(std::string_view level) { logger().set_level(spdlog::level::from_str(std::string(level))); }

}  // namespace ferry

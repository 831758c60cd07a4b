#include "core/log.h"

#include <mutex>

#include <spdlog/sinks/stdout_sinks.h>

#include "core/settings.h"

namespace ferry {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("ferry", sink);
  lg->set_pattern("[ferry] [%l] %v");
  auto level = setting_string("FERRY_LOG_LEVEL");
  lg->set_level(spdlog::level::warn);
  if (level.ok()) {
    lg->set_level(spdlog::level::from_str(*level));
  } else {
    lg->warn("{}", level.status().message());
  }
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

}  // namespace ferry

#include "core/log.h"

#include <memory>
#include <mutex>

#include <spdlog/sinks/sink.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace ferry {
namespace {

// The logger's one sink: stderr, or the installed LogSink. The LogSink is copied out under a lock and
// called without it, so a sink that takes other locks (the GIL) cannot deadlock against set_log_sink.
class DispatchSink final : public spdlog::sinks::sink {
 public:
  void log(const spdlog::details::log_msg& msg) override {
    std::shared_ptr<const LogSink> sink;
    std::string prefix;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sink = sink_;
      if (sink) prefix = prefix_;
    }
    if (!sink) return stderr_.log(msg);
    prefix.append(msg.payload.data(), msg.payload.size());
    (*sink)(msg.level, prefix);
  }
  void flush() override { stderr_.flush(); }
  void set_pattern(const std::string& pattern) override { stderr_.set_pattern(pattern); }
  void set_formatter(std::unique_ptr<spdlog::formatter> f) override { stderr_.set_formatter(std::move(f)); }

  void set_sink(LogSink sink) {
    auto p = sink ? std::make_shared<const LogSink>(std::move(sink)) : nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    sink_.swap(p);  // the old one is released outside the lock, when p goes
  }
  void set_identity(const std::string& identity) {
    std::lock_guard<std::mutex> lock(mu_);
    prefix_ = identity.empty() ? "" : identity + ": ";
  }

 private:
  spdlog::sinks::stderr_sink_mt stderr_;
  std::mutex mu_;
  std::shared_ptr<const LogSink> sink_;
  std::string prefix_;
};

std::shared_ptr<DispatchSink>& dispatch() {
  static std::shared_ptr<DispatchSink> sink = std::make_shared<DispatchSink>();
  return sink;
}

std::shared_ptr<spdlog::logger> make_logger() {
  auto lg = std::make_shared<spdlog::logger>("ferry", dispatch());
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
  dispatch()->set_identity(identity);
}

void set_log_level(std::string_view level) { logger().set_level(spdlog::level::from_str(std::string(level))); }

void set_log_sink(LogSink sink) {
  logger();  // the logger holds the dispatch sink from here on
  dispatch()->set_sink(std::move(sink));
}

}  // namespace ferry

// Catches the warnings ferry logs while it lives (through core/log.h's sink), for tests that assert
// a warning was given; the sink is removed again when it goes. The sink holds the caught warnings
// itself, so a record still being written by another thread as the sink changes is harmless.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/log.h"

namespace ferry::testutil {

class CaughtWarnings {
 public:
  CaughtWarnings() : caught_(std::make_shared<Caught>()) {
    set_log_sink([caught = caught_](spdlog::level::level_enum level, std::string_view msg) {
      std::lock_guard<std::mutex> lock(caught->mu);
      if (level == spdlog::level::warn) caught->warnings.emplace_back(msg);
    });
  }
  ~CaughtWarnings() { set_log_sink({}); }
  CaughtWarnings(const CaughtWarnings&) = delete;
  CaughtWarnings& operator=(const CaughtWarnings&) = delete;

  // How many warnings so far hold both `a` and `b`.
  size_t count(std::string_view a, std::string_view b = {}) const {
    std::lock_guard<std::mutex> lock(caught_->mu);
    size_t n = 0;
    for (const auto& w : caught_->warnings) n += w.find(a) != std::string::npos && w.find(b) != std::string::npos;
    return n;
  }

 private:
  struct Caught {
    std::mutex mu;
    std::vector<std::string> warnings;
  };
  std::shared_ptr<Caught> caught_;
};

}  // namespace ferry::testutil

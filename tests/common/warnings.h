// Catches the warnings ferry logs while it lives (through core/log.h's sink), for tests that assert
// a warning was given; the sink is removed again when it goes.
#pragma once

#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/log.h"

namespace ferry::testutil {

class CaughtWarnings {
 public:
  CaughtWarnings() {
    set_log_sink([this](spdlog::level::level_enum level, std::string_view msg) {
      std::lock_guard<std::mutex> lock(mu_);
      if (level == spdlog::level::warn) warnings_.emplace_back(msg);
    });
  }
  ~CaughtWarnings() { set_log_sink({}); }
  CaughtWarnings(const CaughtWarnings&) = delete;
  CaughtWarnings& operator=(const CaughtWarnings&) = delete;

  // How many warnings so far hold both `a` and `b`.
  size_t count(std::string_view a, std::string_view b = {}) const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& w : warnings_) n += w.find(a) != std::string::npos && w.find(b) != std::string::npos;
    return n;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> warnings_;
};

}  // namespace ferry::testutil

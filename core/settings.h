// Every FERRY_* environment variable is declared once here, with its type, default and help.
// Reading an undeclared name is an internal error; a malformed value is an InvalidArgument that
// names the variable and the value.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry {

enum class SettingType : uint8_t { kBool, kInt, kBytes, kString, kChoice };

struct SettingInfo {
  std::string_view name;
  SettingType type;
  std::string_view default_value;
  std::string_view help;
  std::string_view choices;  // space-separated, for kChoice
};

std::span<const SettingInfo> all_settings();
Result<const SettingInfo*> find_setting(std::string_view name);

// The value in effect: the environment's if set, else the default.
Result<std::string> setting_string(std::string_view name);
Result<int64_t> setting_int(std::string_view name);
Result<bool> setting_bool(std::string_view name);
// Accepts plain bytes or a suffix K, M, G (powers of 1024), e.g. "256M".
Result<uint64_t> setting_bytes(std::string_view name);

// FERRY_BUCKET_BYTES, at least 4 KiB: the one place it is read. The processes that cut buckets (a
// trainer, and the benches and `ferry plan` that model one) take it from here.
Result<uint64_t> bucket_bytes_setting();

// Parsers, exposed for tests and for command-line flags that take the same forms.
Result<int64_t> parse_int(std::string_view text);
Result<bool> parse_bool(std::string_view text);
Result<uint64_t> parse_bytes(std::string_view text);

// Checks every declared variable that is set in the environment; the first malformed one fails.
Status validate_settings();

// FERRY_IO_SPIN_US, read once (0 when malformed, which validate_settings() reports): how long a
// control-plane thread keeps polling after a message before it sleeps.
std::chrono::microseconds io_spin();

}  // namespace ferry

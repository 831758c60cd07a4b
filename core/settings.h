// Every FERRY_* environment variable is declared once here, with its type, default and help, and
// read in one place: load_settings() takes one typed snapshot of them all (keywords, e.g. Python's
// `ferry.Trainer(bucket_bytes="64M")`, beat the environment), at a process's edge: a Trainer, a
// RolloutWorker, a Coordinator, the `ferry` tool, a bench. Below that everything takes its values
// from the snapshot as options (TransportOptions, EngineOptions, ...); no library reads the
// environment. A malformed value is an InvalidArgument that names the variable (or the keyword)
// and the value.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/status.h"

namespace ferry {

// Where a setting's value came from.
enum class SettingSource : uint8_t { kDefault, kEnvironment, kKeyword };
std::string_view source_name(SettingSource source);  // "default", "environment", "keyword"

// The value of every setting. A default-constructed Settings holds the defaults (settings_test
// checks them against the declarations); load_settings() fills it from keywords and environment.
struct Settings {
  std::string log_level = "warn";                  // FERRY_LOG_LEVEL
  std::string coordinator;                         // FERRY_COORDINATOR
  std::string listen_host = "127.0.0.1";           // FERRY_LISTEN_HOST
  int64_t timeout_ms = 30000;                      // FERRY_TIMEOUT_MS, at least 10
  std::string transport = "auto";                  // FERRY_TRANSPORT
  std::string direct = "auto";                     // FERRY_DIRECT
  uint64_t bucket_bytes = uint64_t{64} << 20;      // FERRY_BUCKET_BYTES, at least 4 KiB
  int64_t buckets_in_flight = 4;                   // FERRY_BUCKETS_IN_FLIGHT, at least 1
  uint64_t max_staging_bytes = 0;                  // FERRY_MAX_STAGING_BYTES
  uint64_t max_frame_bytes = uint64_t{64} << 20;   // FERRY_MAX_FRAME_BYTES
  bool verify = false;                             // FERRY_VERIFY
  std::string token;                               // FERRY_TOKEN
  std::string rollback = "off";                    // FERRY_ROLLBACK
  int64_t io_spin_us = 1000;                       // FERRY_IO_SPIN_US, 0 to 1,000,000
  int64_t threads = 0;                             // FERRY_THREADS, 0 (the hardware's) to 4096
  int64_t metrics_port = 0;                        // FERRY_METRICS_PORT, 0 to 65535
  std::string delta = "auto";                      // FERRY_DELTA
  uint64_t delta_max_bytes = uint64_t{64} << 30;   // FERRY_DELTA_MAX_BYTES
  int64_t delta_zstd = 0;                          // FERRY_DELTA_ZSTD, 0 (off) to 19
  std::string delta_shadow = "host";               // FERRY_DELTA_SHADOW
  std::string delta_copy = "host";                 // FERRY_DELTA_COPY
  int64_t tcp_max_mbit = 0;                        // FERRY_TCP_MAX_MBIT, 0 (no cap) to 100,000,000
  std::string stage = "off";                       // FERRY_STAGE

  // Where each value that is not its default came from, by variable name.
  std::map<std::string, SettingSource, std::less<>> sources;
  SettingSource source(std::string_view name) const;

  bool operator==(const Settings&) const = default;
};

enum class SettingType : uint8_t { kBool, kInt, kBytes, kString, kChoice };

// The member of Settings a variable is stored in.
using SettingField =
    std::variant<std::string Settings::*, int64_t Settings::*, uint64_t Settings::*, bool Settings::*>;

struct SettingInfo {
  std::string_view name;
  SettingType type;
  std::string_view default_value;
  std::string_view help;
  std::string_view choices;  // space-separated, for kChoice
  SettingField field;
  int64_t min = 0;  // for kInt and kBytes: the smallest and largest value taken
  int64_t max = INT64_MAX;
};

std::span<const SettingInfo> all_settings();
Result<const SettingInfo*> find_setting(std::string_view name);
// The keyword form of a setting: its name lower-cased without FERRY_ ("bucket_bytes").
std::string setting_keyword(const SettingInfo& info);

// Values given as keywords, by keyword ("bucket_bytes" -> "64M"); they beat the environment.
using SettingOverrides = std::map<std::string, std::string, std::less<>>;

// One setting as it resolves: its text, where it came from, and whether it is well formed.
struct SettingValue {
  const SettingInfo* info = nullptr;
  std::string text;
  SettingSource source = SettingSource::kDefault;
  Status status;  // InvalidArgument naming the variable (or keyword) and value when malformed
};

// Every declared setting in declaration order, from `keywords`, else the environment, else its
// default; this is the one place the environment is read. Fails only for a keyword that names no
// setting (InvalidArgument listing the keywords).
Result<std::vector<SettingValue>> resolve_settings(const SettingOverrides& keywords = {});
// The snapshot: resolve_settings(), where the first malformed value fails.
Result<Settings> load_settings(const SettingOverrides& keywords = {});
// `given` when set (a caller that took its snapshot already), else load_settings().
Result<Settings> settings_or_environment(const std::optional<Settings>& given);

// The text of `info`'s value in `s`, as load_settings() would read it back ("64M", "1", "auto").
std::string setting_text(const Settings& s, const SettingInfo& info);

// Parsers, exposed for tests and for command-line flags that take the same forms.
Result<int64_t> parse_int(std::string_view text);
Result<bool> parse_bool(std::string_view text);
// Accepts plain bytes or a suffix K, M, G (powers of 1024), e.g. "256M".
Result<uint64_t> parse_bytes(std::string_view text);

// The process-wide settings (the log level, FERRY_IO_SPIN_US, FERRY_THREADS) that `s` sets, by environment or
// keyword, apply to the whole process from now on; defaults leave the current values alone. Every
// Trainer, RolloutWorker and Coordinator applies its snapshot when it starts.
void apply_process_settings(const Settings& s);

// How long a control-plane thread keeps polling after a message before it sleeps (FERRY_IO_SPIN_US
// as last applied; 1 ms until then).
std::chrono::microseconds io_spin();

}  // namespace ferry

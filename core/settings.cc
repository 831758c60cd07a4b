#include "core/settings.h"

#include <algorithm>

#include <charconv>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

namespace ferry {
namespace {

constexpr SettingInfo kSettings[] = {
    {"FERRY_LOG_LEVEL", SettingType::kChoice, "warn", "log level", "trace debug info warn error off"},
    {"FERRY_COORDINATOR", SettingType::kString, "", "coordinator address host:port that ranks join", ""},
    {"FERRY_LISTEN_HOST", SettingType::kString, "127.0.0.1", "address the coordinator and data listeners bind to",
     ""},
    {"FERRY_TIMEOUT_MS", SettingType::kInt, "30000", "deadline for every wait in an update, in milliseconds", ""},
    {"FERRY_TRANSPORT", SettingType::kChoice, "auto", "force one data transport", "auto tcp shm cuda_ipc ucx nccl"},
    {"FERRY_DIRECT", SettingType::kChoice, "auto",
     "colocated ranks read a trainer's device tensors in place (CUDA IPC) instead of receiving bytes", "auto off"},
    {"FERRY_BUCKET_BYTES", SettingType::kBytes, "64M", "bytes per bucket that a transport moves", ""},
    {"FERRY_BUCKETS_IN_FLIGHT", SettingType::kInt, "4", "buckets posted and not yet completed, per destination", ""},
    {"FERRY_MAX_STAGING_BYTES", SettingType::kBytes, "0",
     "bound on out-of-order staging per rank; 0 means no bound beyond one layer", ""},
    {"FERRY_MAX_FRAME_BYTES", SettingType::kBytes, "64M", "largest control-plane frame accepted", ""},
    {"FERRY_VERIFY", SettingType::kBool, "0", "checksum every bucket (XXH3-64) on both ends", ""},
    {"FERRY_TOKEN", SettingType::kString, "", "shared secret; when set, joining requires an HMAC-SHA256 answer", ""},
    {"FERRY_ROLLBACK", SettingType::kChoice, "off",
     "host: keep a host copy of each layer before it is overwritten; an aborted update restores it and the "
     "replica resumes on its previous version",
     "off host"},
    {"FERRY_IO_SPIN_US", SettingType::kInt, "1000",
     "microseconds a control-plane thread polls after a message before it sleeps (0: sleeps at once)", ""},
    {"FERRY_METRICS_PORT", SettingType::kInt, "0", "serve Prometheus metrics over HTTP on this port (0: off)", ""},
};

Result<std::string> raw_value(std::string_view name, const SettingInfo** info_out) {
  FERRY_ASSIGN_OR_RETURN(const SettingInfo* info, find_setting(name));
  *info_out = info;
  const char* env = std::getenv(std::string(name).c_str());
  if (env == nullptr) return std::string(info->default_value);
  return std::string(env);
}

Status check_type(const SettingInfo& info, std::string_view value) {
  Status st;
  switch (info.type) {
    case SettingType::kBool: st = parse_bool(value).status(); break;
    case SettingType::kInt: st = parse_int(value).status(); break;
    case SettingType::kBytes: st = parse_bytes(value).status(); break;
    case SettingType::kString: break;
    case SettingType::kChoice: {
      std::string_view rest = info.choices;
      bool found = false;
      while (!rest.empty()) {
        const size_t sp = rest.find(' ');
        if (rest.substr(0, sp) == value) found = true;
        if (sp == std::string_view::npos) break;
        rest.remove_prefix(sp + 1);
      }
      if (!found) st = Status::invalid_argument(fmt::format("expected one of: {}", info.choices));
      break;
    }
  }
  if (!st.ok()) {
    return Status::invalid_argument(fmt::format("{}='{}' is malformed: {}", info.name, value, st.message()));
  }
  return ok_status();
}

}  // namespace

std::span<const SettingInfo> all_settings() { return kSettings; }

Result<const SettingInfo*> find_setting(std::string_view name) {
  for (const SettingInfo& s : kSettings) {
    if (s.name == name) return &s;
  }
  return Status::internal(fmt::format("setting {} is read but never declared", name));
}

Result<int64_t> parse_int(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end) return Status::invalid_argument("not an integer");
  return v;
}

Result<bool> parse_bool(std::string_view text) {
  if (text == "1" || text == "true" || text == "on" || text == "yes") return true;
  if (text == "0" || text == "false" || text == "off" || text == "no" || text.empty()) return false;
  return Status::invalid_argument("not a boolean (use 1/0, true/false, on/off)");
}

Result<uint64_t> parse_bytes(std::string_view text) {
  if (text.empty()) return Status::invalid_argument("empty size");
  uint64_t mult = 1;
  switch (text.back()) {
    case 'K': case 'k': mult = 1ull << 10; break;
    case 'M': case 'm': mult = 1ull << 20; break;
    case 'G': case 'g': mult = 1ull << 30; break;
    default: break;
  }
  if (mult != 1) text.remove_suffix(1);
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end) return Status::invalid_argument("not a size (e.g. 4096, 64K, 256M, 1G)");
  if (v > std::numeric_limits<uint64_t>::max() / mult) return Status::invalid_argument("size overflows 64 bits");
  return v * mult;
}

Result<std::string> setting_string(std::string_view name) {
  const SettingInfo* info = nullptr;
  FERRY_ASSIGN_OR_RETURN(std::string v, raw_value(name, &info));
  FERRY_RETURN_IF_ERROR(check_type(*info, v));
  return v;
}

Result<int64_t> setting_int(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(std::string v, setting_string(name));
  return parse_int(v);
}

Result<bool> setting_bool(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(std::string v, setting_string(name));
  return parse_bool(v);
}

Result<uint64_t> setting_bytes(std::string_view name) {
  FERRY_ASSIGN_OR_RETURN(std::string v, setting_string(name));
  return parse_bytes(v);
}

Result<uint64_t> bucket_bytes_setting() {
  FERRY_ASSIGN_OR_RETURN(const uint64_t bytes, setting_bytes("FERRY_BUCKET_BYTES"));
  if (bytes < 4096) return Status::invalid_argument(fmt::format("FERRY_BUCKET_BYTES={} is below 4K", bytes));
  return bytes;
}

Status validate_settings() {
  for (const SettingInfo& s : kSettings) {
    FERRY_RETURN_IF_ERROR(setting_string(s.name).status());
  }
  return ok_status();
}

std::chrono::microseconds io_spin() {
  static const std::chrono::microseconds spin = [] {
    auto v = setting_int("FERRY_IO_SPIN_US");
    return std::chrono::microseconds(v.ok() ? std::clamp<int64_t>(*v, 0, 1'000'000) : 0);
  }();
  return spin;
}

}  // namespace ferry

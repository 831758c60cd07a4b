#include "core/settings.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include <fmt/format.h>

#include "core/log.h"
#include "core/parallel.h"

namespace ferry {
namespace {

constexpr SettingInfo kSettings[] = {
    {"FERRY_LOG_LEVEL", SettingType::kChoice, "warn", "log level", "trace debug info warn error off",
     &Settings::log_level},
    {"FERRY_COORDINATOR", SettingType::kString, "", "coordinator address host:port that ranks join", "",
     &Settings::coordinator},
    {"FERRY_LISTEN_HOST", SettingType::kString, "127.0.0.1", "address the coordinator and data listeners bind to", "",
     &Settings::listen_host},
    {"FERRY_TIMEOUT_MS", SettingType::kInt, "30000", "deadline for every wait in an update, in milliseconds", "",
     &Settings::timeout_ms, 10},
    {"FERRY_TRANSPORT", SettingType::kChoice, "auto", "force one data transport", "auto tcp shm cuda_ipc ucx nccl",
     &Settings::transport},
    {"FERRY_DIRECT", SettingType::kChoice, "auto",
     "colocated ranks read a trainer's device tensors in place (CUDA IPC) instead of receiving bytes", "auto off",
     &Settings::direct},
    {"FERRY_BUCKET_BYTES", SettingType::kBytes, "64M", "bytes per bucket that a transport moves", "",
     &Settings::bucket_bytes, 4096},
    {"FERRY_BUCKETS_IN_FLIGHT", SettingType::kInt, "4", "buckets posted and not yet completed, per destination", "",
     &Settings::buckets_in_flight, 1},
    {"FERRY_MAX_STAGING_BYTES", SettingType::kBytes, "0",
     "bound on out-of-order staging per rank; 0 means no bound beyond one layer", "", &Settings::max_staging_bytes},
    {"FERRY_MAX_FRAME_BYTES", SettingType::kBytes, "64M", "largest control-plane frame accepted", "",
     &Settings::max_frame_bytes},
    {"FERRY_VERIFY", SettingType::kBool, "0", "checksum every bucket (XXH3-64) on both ends", "", &Settings::verify},
    {"FERRY_TOKEN", SettingType::kString, "", "shared secret; when set, joining requires an HMAC-SHA256 answer", "",
     &Settings::token},
    {"FERRY_ROLLBACK", SettingType::kChoice, "off",
     "host: keep a host copy of each layer before it is overwritten; an aborted update restores it and the "
     "replica resumes on its previous version",
     "off host", &Settings::rollback},
    {"FERRY_IO_SPIN_US", SettingType::kInt, "1000",
     "microseconds a control-plane thread polls after a message before it sleeps (0: sleeps at once)", "",
     &Settings::io_spin_us, 0, 1'000'000},
    {"FERRY_THREADS", SettingType::kInt, "0",
     "host threads one process spreads its large copies, compares and CPU quantization over (0: the hardware's); "
     "set it where several ferry processes share a host's cores",
     "", &Settings::threads, 0, 4096},
    {"FERRY_METRICS_PORT", SettingType::kInt, "0", "serve Prometheus metrics over HTTP on this port (0: off)", "",
     &Settings::metrics_port, 0, 65535},
    {"FERRY_DELTA", SettingType::kChoice, "auto",
     "trainer: send each piece as the elements changed since the version a rank holds, when smaller than its "
     "bytes (auto: to ranks on other hosts only, none kept when every rank is on this one; on: to every rank; "
     "always: every piece a rank can take so, smaller or not; off: every byte, and no copy kept)",
     "auto on off always", &Settings::delta},
    {"FERRY_DELTA_MAX_BYTES", SettingType::kBytes, "64G",
     "trainer: bound on the copy of the last version sent, which deltas are computed against (host memory, or GPU "
     "memory under FERRY_DELTA_COPY=device); tensors past it are sent whole",
     "", &Settings::delta_max_bytes},
    {"FERRY_DELTA_ZSTD", SettingType::kInt, "0",
     "trainer: zstd level for delta pieces, whose changed values then travel as XORs with the old ones "
     "(about 2.4 x fewer bytes than plain deltas for Adam steps; pays on links of about 1 Gbit/s and slower); 0: off",
     "", &Settings::delta_zstd, 0, 19},
    {"FERRY_DELTA_COPY", SettingType::kChoice, "host",
     "trainer: where a GPU tensor's copy of the last version sent is kept: host (the tensor crosses to the host "
     "and is compared there), or device (kept in its GPU's memory and compared there; only the changes cross)",
     "host device", &Settings::delta_copy},
    {"FERRY_DELTA_SHADOW", SettingType::kChoice, "host",
     "rank: keep a full-precision copy of its shard so that deltas apply on top of it: in host memory, or "
     "(device) in its GPU's memory, where only the changed elements then cross to the device (off: every update to "
     "this rank is sent whole)",
     "host device off", &Settings::delta_shadow},
    {"FERRY_TCP_MAX_MBIT", SettingType::kInt, "0",
     "sender: the most each tcp data connection sends, in Mbit/s, paced by the kernel (SO_MAX_PACING_RATE), so that "
     "updates leave room on a link they share; 0: no cap",
     "", &Settings::tcp_max_mbit, 0, 100'000'000},
    {"FERRY_STAGE", SettingType::kChoice, "off",
     "trainer: ranks receive each update into staging while they serve, and pause only to apply it "
     "(needs host memory for a rank's full-precision input, within FERRY_MAX_STAGING_BYTES)",
     "off on", &Settings::stage},
};

Status check_choice(const SettingInfo& info, std::string_view value) {
  std::string_view rest = info.choices;
  while (!rest.empty()) {
    const size_t sp = rest.find(' ');
    if (rest.substr(0, sp) == value) return ok_status();
    if (sp == std::string_view::npos) break;
    rest.remove_prefix(sp + 1);
  }
  return Status::invalid_argument(fmt::format("expected one of: {}", info.choices));
}

template <typename T>
Status check_range(const SettingInfo& info, const Result<T>& v) {
  if (!v.ok()) return v.status();
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  const Wide lo = static_cast<Wide>(info.min), hi = static_cast<Wide>(info.max);
  const Wide x = static_cast<Wide>(*v);
  if (x < lo || x > hi) {
    return Status::invalid_argument(info.max == INT64_MAX ? fmt::format("below {}", info.min)
                                                          : fmt::format("outside {} to {}", info.min, info.max));
  }
  return ok_status();
}

// `value` as a value of `info`, or why not; `shown_as` is how the caller wrote its name.
Status check_value(const SettingInfo& info, std::string_view shown_as, std::string_view value) {
  Status st;
  switch (info.type) {
    case SettingType::kBool: st = parse_bool(value).status(); break;
    case SettingType::kInt: st = check_range(info, parse_int(value)); break;
    case SettingType::kBytes: st = check_range(info, parse_bytes(value)); break;
    case SettingType::kString: break;
    case SettingType::kChoice: st = check_choice(info, value); break;
  }
  if (!st.ok()) {
    return Status::invalid_argument(fmt::format("{}='{}' is malformed: {}", shown_as, value, st.message()));
  }
  return ok_status();
}

std::string keyword_list() {
  std::string out;
  for (const SettingInfo& s : kSettings) out += (out.empty() ? "" : ", ") + setting_keyword(s);
  return out;
}

std::atomic<int64_t>& io_spin_us() {
  static std::atomic<int64_t> us{Settings{}.io_spin_us};
  return us;
}

}  // namespace

std::string_view source_name(SettingSource source) {
  switch (source) {
    case SettingSource::kDefault: return "default";
    case SettingSource::kEnvironment: return "environment";
    case SettingSource::kKeyword: return "keyword";
  }
  return "?";
}

SettingSource Settings::source(std::string_view name) const {
  auto it = sources.find(name);
  return it == sources.end() ? SettingSource::kDefault : it->second;
}

std::span<const SettingInfo> all_settings() { return kSettings; }

Result<const SettingInfo*> find_setting(std::string_view name) {
  for (const SettingInfo& s : kSettings) {
    if (s.name == name) return &s;
  }
  return Status::internal(fmt::format("setting {} is read but never declared", name));
}

std::string setting_keyword(const SettingInfo& info) {
  std::string out(info.name.substr(std::string_view("FERRY_").size()));
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
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

Result<std::vector<SettingValue>> resolve_settings(const SettingOverrides& keywords) {
  for (const auto& entry : keywords) {
    const auto& key = entry.first;  // a name, not a structured binding: lambdas capture it in C++17 compilers too
    const bool known = std::any_of(std::begin(kSettings), std::end(kSettings),
                                   [&](const SettingInfo& s) { return setting_keyword(s) == key; });
    if (!known) {
      return Status::invalid_argument(fmt::format("unknown setting keyword '{}'; the settings are: {}", key,
                                                  keyword_list()));
    }
  }
  std::vector<SettingValue> out;
  for (const SettingInfo& s : kSettings) {
    SettingValue v{&s, std::string(s.default_value), SettingSource::kDefault, ok_status()};
    const std::string keyword = setting_keyword(s);
    if (auto it = keywords.find(keyword); it != keywords.end()) {
      v.text = it->second;
      v.source = SettingSource::kKeyword;
    } else if (const char* env = std::getenv(std::string(s.name).c_str()); env != nullptr) {
      v.text = env;
      v.source = SettingSource::kEnvironment;
    }
    v.status = check_value(s, v.source == SettingSource::kKeyword ? std::string_view(keyword) : s.name, v.text);
    out.push_back(std::move(v));
  }
  return out;
}

Result<Settings> load_settings(const SettingOverrides& keywords) {
  FERRY_ASSIGN_OR_RETURN(std::vector<SettingValue> values, resolve_settings(keywords));
  Settings s;
  for (const SettingValue& v : values) {
    FERRY_RETURN_IF_ERROR(v.status);
    std::visit(
        [&](auto field) {
          using T = std::remove_reference_t<decltype(s.*field)>;
          if constexpr (std::is_same_v<T, std::string>) {
            s.*field = v.text;
          } else if constexpr (std::is_same_v<T, bool>) {
            s.*field = parse_bool(v.text).value();
          } else if constexpr (std::is_same_v<T, int64_t>) {
            s.*field = parse_int(v.text).value();
          } else {
            s.*field = parse_bytes(v.text).value();
          }
        },
        v.info->field);
    if (v.source != SettingSource::kDefault) s.sources.emplace(std::string(v.info->name), v.source);
  }
  return s;
}

Result<Settings> settings_or_environment(const std::optional<Settings>& given) {
  if (given) return *given;
  return load_settings();
}

std::string setting_text(const Settings& s, const SettingInfo& info) {
  return std::visit(
      [&](auto field) -> std::string {
        const auto& v = s.*field;
        using T = std::remove_cvref_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "1" : "0";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return std::to_string(v);
        } else {
          for (const auto& [shift, suffix] : {std::pair{30, 'G'}, std::pair{20, 'M'}, std::pair{10, 'K'}}) {
            if (v != 0 && v % (uint64_t{1} << shift) == 0) return fmt::format("{}{}", v >> shift, suffix);
          }
          return std::to_string(v);
        }
      },
      info.field);
}

void apply_process_settings(const Settings& s) {
  if (s.source("FERRY_LOG_LEVEL") != SettingSource::kDefault) set_log_level(s.log_level);
  if (s.source("FERRY_IO_SPIN_US") != SettingSource::kDefault) io_spin_us().store(s.io_spin_us);
  if (s.source("FERRY_THREADS") != SettingSource::kDefault) set_host_threads(static_cast<size_t>(s.threads));
}

std::chrono::microseconds io_spin() { return std::chrono::microseconds(io_spin_us().load(std::memory_order_relaxed)); }

}  // namespace ferry

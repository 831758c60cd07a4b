#include "core/settings.h"

#include <cstdlib>
#include <type_traits>

#include <gtest/gtest.h>

#include "core/parallel.h"
#include "tests/common/scoped_env.h"

namespace ferry {
namespace {

using testutil::ScopedEnv;

TEST(Settings, DefaultsApplyWhenUnset) {
  auto s = load_settings();
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->bucket_bytes, 64ull << 20);
  EXPECT_EQ(s->timeout_ms, 30000);
  EXPECT_FALSE(s->verify);
  EXPECT_TRUE(s->sources.empty());
  // A default-constructed Settings holds the declared defaults, field by field.
  EXPECT_EQ(*s, Settings{});
  for (const SettingInfo& info : all_settings()) {
    EXPECT_EQ(setting_text(Settings{}, info), info.default_value) << info.name;
    EXPECT_EQ(s->source(info.name), SettingSource::kDefault) << info.name;
  }
}

TEST(Settings, ParsesSuffixes) {
  {
    ScopedEnv env("FERRY_BUCKET_BYTES", "8K");
    EXPECT_EQ(load_settings()->bucket_bytes, 8192u);
  }
  ScopedEnv env("FERRY_BUCKET_BYTES", "2G");
  EXPECT_EQ(load_settings()->bucket_bytes, 2ull << 30);
}

TEST(Settings, MalformedValueNamesVariableAndValue) {
  ScopedEnv env("FERRY_TIMEOUT_MS", "12x");
  auto r = load_settings();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("FERRY_TIMEOUT_MS='12x'"), std::string::npos) << r.status().message();
}

TEST(Settings, ChoiceOutsideListIsRejected) {
  ScopedEnv env("FERRY_TRANSPORT", "carrier-pigeon");
  auto r = load_settings();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tcp"), std::string::npos);
}

TEST(Settings, ValuesOutOfRangeAreRejected) {
  for (const auto& [name, value] : {std::pair{"FERRY_BUCKET_BYTES", "1K"}, std::pair{"FERRY_BUCKETS_IN_FLIGHT", "0"},
                                    std::pair{"FERRY_TIMEOUT_MS", "5"}, std::pair{"FERRY_METRICS_PORT", "70000"},
                                    std::pair{"FERRY_IO_SPIN_US", "-1"}}) {
    ScopedEnv env(name, value);
    auto r = load_settings();
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_NE(r.status().message().find(std::string(name) + "='" + value + "'"), std::string::npos)
        << r.status().message();
  }
}

TEST(Settings, UndeclaredNameIsInternalError) {
  auto r = find_setting("FERRY_NOT_A_SETTING");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Settings, EverySettingHasHelpAFieldOfItsTypeAndAKeyword) {
  for (const SettingInfo& s : all_settings()) {
    EXPECT_FALSE(s.help.empty()) << s.name;
    EXPECT_TRUE(s.name.starts_with("FERRY_")) << s.name;
    const bool matches = std::visit(
        [&](auto field) {
          using T = std::remove_cvref_t<decltype(Settings{}.*field)>;
          switch (s.type) {
            case SettingType::kBool: return std::is_same_v<T, bool>;
            case SettingType::kInt: return std::is_same_v<T, int64_t>;
            case SettingType::kBytes: return std::is_same_v<T, uint64_t>;
            case SettingType::kString: case SettingType::kChoice: return std::is_same_v<T, std::string>;
          }
          return false;
        },
        s.field);
    EXPECT_TRUE(matches) << s.name;
  }
  EXPECT_EQ(setting_keyword(*find_setting("FERRY_BUCKET_BYTES").value()), "bucket_bytes");
}

// A keyword beats the environment, which beats the default; each value reports where it came from.
TEST(Settings, KeywordBeatsEnvironmentAndEachSourceIsReported) {
  ScopedEnv bucket("FERRY_BUCKET_BYTES", "8K");
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "5000");
  ScopedEnv transport("FERRY_TRANSPORT", "carrier-pigeon");  // malformed, but a keyword replaces it unread
  auto s = load_settings({{"bucket_bytes", "64M"}, {"transport", "tcp"}, {"verify", "1"}});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->bucket_bytes, 64ull << 20);
  EXPECT_EQ(s->transport, "tcp");
  EXPECT_TRUE(s->verify);
  EXPECT_EQ(s->timeout_ms, 5000);
  EXPECT_EQ(s->source("FERRY_BUCKET_BYTES"), SettingSource::kKeyword);
  EXPECT_EQ(s->source("FERRY_TRANSPORT"), SettingSource::kKeyword);
  EXPECT_EQ(s->source("FERRY_TIMEOUT_MS"), SettingSource::kEnvironment);
  EXPECT_EQ(s->source("FERRY_LISTEN_HOST"), SettingSource::kDefault);

  // What `ferry info` prints: every setting, its text and its source.
  auto values = resolve_settings({{"bucket_bytes", "64M"}});
  ASSERT_TRUE(values.ok());
  ASSERT_EQ(values->size(), all_settings().size());
  for (const SettingValue& v : *values) {
    if (v.info->name == "FERRY_BUCKET_BYTES") {
      EXPECT_EQ(v.text, "64M");
      EXPECT_EQ(source_name(v.source), "keyword");
    } else if (v.info->name == "FERRY_TIMEOUT_MS") {
      EXPECT_EQ(v.text, "5000");
      EXPECT_EQ(source_name(v.source), "environment");
    } else if (v.info->name == "FERRY_TRANSPORT") {
      EXPECT_FALSE(v.status.ok());  // from the environment now, and malformed
    } else if (v.info->name == "FERRY_VERIFY") {
      EXPECT_EQ(source_name(v.source), "default");
    }
  }
}

TEST(Settings, MalformedOrUnknownKeywordsAreNamed) {
  auto bad = load_settings({{"timeout_ms", "soon"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("timeout_ms='soon'"), std::string::npos) << bad.status().message();
  auto unknown = load_settings({{"bucket_byte", "64M"}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("'bucket_byte'"), std::string::npos) << unknown.status().message();
  EXPECT_NE(unknown.status().message().find("bucket_bytes"), std::string::npos) << unknown.status().message();
}

TEST(Settings, GivenSnapshotIsUsedWithoutReadingTheEnvironment) {
  ScopedEnv env("FERRY_TIMEOUT_MS", "12x");
  EXPECT_FALSE(settings_or_environment(std::nullopt).ok());
  Settings given;
  given.timeout_ms = 777;
  auto s = settings_or_environment(given);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->timeout_ms, 777);
}

// Process-wide values follow a snapshot that sets them; a snapshot of defaults leaves them alone.
TEST(Settings, ProcessSettingsApplyOnlyWhereSet) {
  const auto before = io_spin();
  Settings s;
  s.io_spin_us = 5;
  apply_process_settings(s);
  EXPECT_EQ(io_spin(), before);
  s.sources["FERRY_IO_SPIN_US"] = SettingSource::kKeyword;
  apply_process_settings(s);
  EXPECT_EQ(io_spin(), std::chrono::microseconds(5));
  s.io_spin_us = before.count();
  apply_process_settings(s);
  EXPECT_EQ(io_spin(), before);
}

// FERRY_THREADS bounds the threads a process's own work takes: the slices of a large copy, a
// rank's CPU quantization (resolved from host_threads()), the lanes of a same-host ucx connection.
TEST(Settings, ThreadsBoundTheSlicesOfHostWork) {
  const size_t hardware = host_threads();
  Settings s;
  s.threads = 1;
  s.sources["FERRY_THREADS"] = SettingSource::kEnvironment;
  apply_process_settings(s);
  EXPECT_EQ(host_threads(), 1u);
  EXPECT_EQ(slices_for(size_t{1} << 30, 1), 1u) << "one thread: a large copy is one slice";
  s.threads = 3;
  apply_process_settings(s);
  EXPECT_EQ(slices_for(size_t{1} << 30, 1), 3u);
  EXPECT_EQ(slices_for(size_t{1} << 30, size_t{1} << 29), 2u) << "still no slice under its least";
  s.threads = 0;  // the hardware's again
  apply_process_settings(s);
  EXPECT_EQ(host_threads(), hardware);
  EXPECT_EQ(slices_for(size_t{1} << 30, 1), std::min<size_t>(hardware, 8));
}

TEST(ParseBytes, RejectsOverflowAndGarbage) {
  EXPECT_FALSE(parse_bytes("").ok());
  EXPECT_FALSE(parse_bytes("M").ok());
  EXPECT_FALSE(parse_bytes("-1").ok());
  EXPECT_FALSE(parse_bytes("99999999999999999999G").ok());
  EXPECT_EQ(*parse_bytes("17"), 17u);
}

}  // namespace
}  // namespace ferry

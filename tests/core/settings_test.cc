#include "core/settings.h"

#include <cstdlib>

#include <gtest/gtest.h>

namespace ferry {
namespace {

class SettingsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    unsetenv("FERRY_BUCKET_BYTES");
    unsetenv("FERRY_TIMEOUT_MS");
    unsetenv("FERRY_VERIFY");
    unsetenv("FERRY_TRANSPORT");
  }
};

TEST_F(SettingsTest, DefaultsApplyWhenUnset) {
  EXPECT_EQ(*setting_bytes("FERRY_BUCKET_BYTES"), 64ull << 20);
  EXPECT_EQ(*setting_int("FERRY_TIMEOUT_MS"), 30000);
  EXPECT_FALSE(*setting_bool("FERRY_VERIFY"));
}

TEST_F(SettingsTest, ParsesSuffixes) {
  setenv("FERRY_BUCKET_BYTES", "3K", 1);
  EXPECT_EQ(*setting_bytes("FERRY_BUCKET_BYTES"), 3072u);
  setenv("FERRY_BUCKET_BYTES", "2G", 1);
  EXPECT_EQ(*setting_bytes("FERRY_BUCKET_BYTES"), 2ull << 30);
}

TEST_F(SettingsTest, MalformedValueNamesVariableAndValue) {
  setenv("FERRY_TIMEOUT_MS", "12x", 1);
  auto r = setting_int("FERRY_TIMEOUT_MS");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("FERRY_TIMEOUT_MS='12x'"), std::string::npos) << r.status().message();
  EXPECT_FALSE(validate_settings().ok());
}

TEST_F(SettingsTest, ChoiceOutsideListIsRejected) {
  setenv("FERRY_TRANSPORT", "carrier-pigeon", 1);
  auto r = setting_string("FERRY_TRANSPORT");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tcp"), std::string::npos);
}

TEST_F(SettingsTest, UndeclaredNameIsInternalError) {
  auto r = setting_string("FERRY_NOT_A_SETTING");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST_F(SettingsTest, EverySettingHasHelpAndValidDefault) {
  for (const SettingInfo& s : all_settings()) {
    EXPECT_FALSE(s.help.empty()) << s.name;
    EXPECT_TRUE(s.name.starts_with("FERRY_")) << s.name;
    EXPECT_TRUE(setting_string(s.name).ok()) << s.name;
  }
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

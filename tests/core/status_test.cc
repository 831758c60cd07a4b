#include "core/status.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

Result<int> half(int v) {
  if (v % 2) return Status::invalid_argument("odd: " + std::to_string(v));
  return v / 2;
}

Result<int> quarter(int v) {
  FERRY_ASSIGN_OR_RETURN(int h, half(v));
  FERRY_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.to_string(), "OK");
}

TEST(Status, CarriesCodeAndContext) {
  Status s = Status::data_loss("checksum").with_context("bucket 3");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.to_string(), "DataLoss: bucket 3: checksum");
}

TEST(Result, PropagatesFirstError) {
  EXPECT_EQ(*quarter(8), 2);
  Result<int> r = quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd: 3");
}

TEST(Result, OkStatusIsNotAValue) {
  Result<int> r{Status()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace ferry

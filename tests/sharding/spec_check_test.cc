// The linear slice checks (a sweep over destination boxes) against the quadratic statement of the
// same checks: the same verdict and the same first error, over random parameters.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "sharding/spec_check.h"

namespace ferry::sharding {
namespace {

int64_t pick(std::mt19937& rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

TEST(SpecCheck, LinearChecksAgreeWithTheQuadraticOnes) {
  std::mt19937 rng(24);
  const Shape source_shape{8, 6};
  int errors = 0, overlaps = 0;
  for (int round = 0; round < 20000; ++round) {
    ParamSpec p;
    p.name = "p" + std::to_string(round);
    const bool stacked = round % 2 == 1;  // [experts, rows, cols] fed by 2-D slices
    p.shape = stacked ? Shape{4, 8, 6} : Shape{16, 6};
    const int64_t n = pick(rng, 0, 9);
    std::vector<const Shape*> shapes;
    for (int64_t i = 0; i < n; ++i) {
      SourceSlice s;
      s.source = "t" + std::to_string(i);
      const int64_t rows = pick(rng, 0, 5), cols = pick(rng, 1, 6);
      s.src = Region{{pick(rng, 0, 4), pick(rng, 0, 6 - cols + (round % 7 == 0 ? 1 : 0))}, {rows, cols}};
      // Mostly tiles laid one after another, sometimes anywhere (overlaps, outside the parameter).
      const bool tidy = pick(rng, 0, 3) > 0;
      if (stacked) {
        s.dst_offset = {tidy ? i % 4 : pick(rng, 0, 4), tidy ? (i / 4) * 4 : pick(rng, 0, 8), tidy ? 0 : pick(rng, 0, 2)};
      } else {
        s.dst_offset = {tidy ? i * 2 : pick(rng, 0, 16), tidy ? 0 : pick(rng, 0, 3)};
      }
      if (round % 97 == 0) s.dst_offset.pop_back();  // a rank the destination cannot take
      p.slices.push_back(std::move(s));
      shapes.push_back(pick(rng, 0, 60) == 0 ? nullptr : &source_shape);
    }
    const Status fast = check_param_slices(p, shapes);
    const Status slow = first_slice_error(p, shapes);
    ASSERT_EQ(fast.ok(), slow.ok()) << "round " << round << ": " << slow.to_string();
    ASSERT_EQ(fast.to_string(), slow.to_string()) << "round " << round;
    errors += !slow.ok();
    overlaps += slow.message().find("overlap") != std::string::npos;
  }
  // The random cases reach both verdicts, and overlaps among the errors.
  EXPECT_GT(errors, 1000);
  EXPECT_LT(errors, 19000);
  EXPECT_GT(overlaps, 100);
}

}  // namespace
}  // namespace ferry::sharding

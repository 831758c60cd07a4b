// Storage bytes after a real update, for every online quantization scheme: a trainer and a TP
// replica over real sockets, and every registered storage tensor of every rank compared byte for
// byte with an expectation built without ferry's sharding or kernels (scheme_bytes.h).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "tests/coordinator/scheme_bytes.h"

namespace ferry::testutil {
namespace {

// Every online scheme x {KV heads above TP, below TP}.
struct Case {
  Scheme scheme;
  Config (*config)();
};

void PrintTo(const Case& c, std::ostream* os) { *os << scheme_name(c.scheme) << " " << c.config().name; }

class SchemeBytes : public ::testing::TestWithParam<Case> {};

TEST_P(SchemeBytes, EveryStorageTensorOfEveryRankMatchesTheReference) {
  const Config cfg = GetParam().config();
  const Scheme scheme = GetParam().scheme;
  const std::string name(scheme_name(scheme));
  const Layout layout = make_layout(cfg, name);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Cluster c(cfg.tp, name, cfg.llama);
  Status st = c.start();
  ASSERT_TRUE(st.ok()) << st.to_string();
  scribble(c);

  // Two versions into the same storage: the second overwrites every byte of the first.
  for (uint64_t v = 1; v <= 2; ++v) {
    const Checkpoint ck = make_checkpoint(c.manifest(), 100 + v);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    expect_storage(c, expected_storage(cfg, layout, scheme, ck), fmt::format("{} v{}", name, v));
    for (int i = 0; i < c.tp(); ++i) {
      EXPECT_EQ(c.rank(i).worker->weight_version(), v);
      EXPECT_TRUE(c.rank(i).worker->consistent());
    }
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Scheme s : kAllSchemes) {
    if (s == Scheme::kGptqInt4) continue;  // quantized reload, not an online scheme
    out.push_back({s, kv_above_tp});
    out.push_back({s, kv_below_tp});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllOnlineSchemes, SchemeBytes, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string s(scheme_name(info.param.scheme));
                           std::erase(s, '_');
                           return s + "_" + info.param.config().name;
                         });

}  // namespace
}  // namespace ferry::testutil

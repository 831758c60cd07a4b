// A delta against a version the rank does not hold is never applied; the rank gets dense bytes
// instead. The trainer sends a rank deltas only against a version the rank said its shadow holds,
// both at the end of its last update and as this one begins (PauseAck.delta_base):
// - a rank whose shadow silently lost its version after it reported it
//   (reload::set_shadow_base_hook_for_testing, at kBegin) says so as the update begins, and gets
//   dense bytes in that same update while the other rank gets deltas;
// - a rank that reports a base it does not hold (kReport as well) has the rank's own check as the
//   last line: its delta pieces are refused with the tensor and both versions named, the update
//   fails with nothing of it served, and the next update goes dense to that replica.
// Both land the reference's bytes.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include <fmt/format.h>

#include "reload/engine.h"
#include "tests/common/scoped_env.h"
#include "tests/common/warnings.h"
#include "tests/coordinator/scheme_bytes.h"
#include "tests/coordinator/version_changes.h"

namespace ferry::testutil {
namespace {

struct HookReset {
  ~HookReset() { reload::set_shadow_base_hook_for_testing({}); }
};

// Two updates of one replica, the second as deltas to every rank.
class DeltaRefusal : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(c.start().ok());
    ASSERT_TRUE(c.update(1, ck).ok());
    nudge(ck, 0.01, rng);
    auto r = c.update(2, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    for (const auto& d : r->delta) ASSERT_GT(d.delta_bytes, 0u) << "v2 travels as deltas";
  }

  ScopedEnv transport{"FERRY_TRANSPORT", "tcp"};
  ScopedEnv delta{"FERRY_DELTA", "on"};
  const Config cfg = kv_below_tp();
  const Layout layout = make_layout(cfg, "fp8_per_channel");
  HookReset reset;
  Cluster c{cfg.tp, "fp8_per_channel", cfg.llama};
  Checkpoint ck = make_checkpoint(c.manifest(), 21);
  std::mt19937_64 rng{5};
};

TEST_F(DeltaRefusal, ARankWhoseShadowLostItsVersionGetsDenseBytesInTheSameUpdate) {
  // Rank 1 reported that its shadow holds v2; as v3 begins, it holds something else, and says so.
  reload::set_shadow_base_hook_for_testing([](const sharding::RankSpec& spec, reload::ShadowBaseAt at, uint64_t& base) {
    if (spec.tp_rank == 1 && at == reload::ShadowBaseAt::kBegin) base = 77;
  });
  nudge(ck, 0.01, rng);
  CaughtWarnings caught;
  auto r = c.update(3, ck);
  reload::set_shadow_base_hook_for_testing({});
  EXPECT_EQ(caught.count("reported delta base v2", "holds v77 as v3 begins; it gets dense bytes"), 1u);
  ASSERT_TRUE(r.ok()) << "the rank that lost its base should have had dense bytes: " << r.status().to_string();
  ASSERT_EQ(r->delta.size(), static_cast<size_t>(c.tp()));  // in plan order: by rank
  for (int i = 0; i < c.tp(); ++i) {
    if (i == 1) {
      EXPECT_EQ(r->delta[1].delta_bytes, 0u) << "rank 1 holds no v2: no deltas";
      EXPECT_GT(r->delta[1].dense_bytes, 0u);
    } else {
      EXPECT_GT(r->delta[i].delta_bytes, 0u) << "rank " << i << " holds v2: deltas";
    }
  }
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), "v3");
  for (int i = 0; i < c.tp(); ++i) EXPECT_EQ(c.rank(i).worker->weight_version(), 3u) << "rank " << i;

  // Its dense v3 gave its shadow a version again: deltas to both.
  nudge(ck, 0.01, rng);
  r = c.update(4, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (const auto& d : r->delta) EXPECT_GT(d.delta_bytes, 0u) << "v4 travels as deltas";
  expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), "v4");
}

TEST_F(DeltaRefusal, ADeltaAgainstAVersionTheRankDoesNotHoldIsRefusedAndTheNextUpdateIsDense) {
  // Rank 1's shadow holds something else than v2 as v3 begins, yet it reports v2.
  reload::set_shadow_base_hook_for_testing([](const sharding::RankSpec& spec, reload::ShadowBaseAt at, uint64_t& base) {
    if (spec.tp_rank == 1) base = at == reload::ShadowBaseAt::kBegin ? 77 : 2;
  });
  nudge(ck, 0.01, rng);
  auto r = c.update(3, ck);
  reload::set_shadow_base_hook_for_testing({});
  ASSERT_FALSE(r.ok()) << "a delta against a version the rank does not hold was applied";
  const std::string why = r.status().to_string();
  EXPECT_NE(why.find("against v2 refused, not applied"), std::string::npos) << why;
  EXPECT_NE(why.find("v77"), std::string::npos) << why;
  bool named = false;
  for (const auto& t : c.manifest()) named = named || why.find(t.name + ": delta piece") != std::string::npos;
  EXPECT_TRUE(named) << "the refusal names a checkpoint tensor: " << why;
  for (int i = 0; i < c.tp(); ++i) {
    EXPECT_NE(c.rank(i).worker->weight_version(), 3u) << "rank " << i << " serves the refused update";
  }

  // The next update goes dense to the replica whose update failed; the one after, deltas again.
  for (const uint64_t v : {4, 5}) {
    nudge(ck, 0.01, rng);
    r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
    for (const auto& d : r->delta) {
      EXPECT_EQ(d.delta_bytes == 0, v == 4) << "v" << v << ": " << d.delta_bytes << " bytes of deltas";
      if (v == 4) {
        EXPECT_GT(d.dense_bytes, 0u);
      }
    }
    expect_storage(c, expected_storage(cfg, layout, Scheme::kFp8PerChannel, ck), fmt::format("v{}", v));
  }
}

}  // namespace
}  // namespace ferry::testutil

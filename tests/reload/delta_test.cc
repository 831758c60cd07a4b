// The engine's delta shadow: a delta applies only on top of exactly the version the shadow holds
// complete, never on any other (nor without a shadow), and the shadow holds no version after an
// update that failed, was rolled back, or bypassed it.
#include <cstring>

#include "reload/checkpoint_loader.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::contents;
using testing::make_rank;

EngineOptions shadow(bool on, RollbackMode rollback = RollbackMode::kOff) {
  EngineOptions o;
  o.delta_shadow = on;
  o.rollback = rollback;
  return o;
}

// The first piece of the first parameter with a slice, as a delta that flips every element.
Status delta_on_first(ReloadEngine& e, uint64_t base, bool* applied) {
  const auto& p = e.spec().params.front();
  const Region dst = sharding::slice_dst_region(p.slices.front(), p);
  const DType dtype = e.input_layout(0).front().dtype;
  return e.take_delta_piece(0, 0, dst, dtype, dtype_bytes(dtype, dst.numel()), base, [applied](uint8_t* v, size_t n) {
    for (size_t i = 0; i < n; ++i) v[i] ^= 0xff;
    *applied = true;
    return ok_status();
  });
}

TEST(DeltaShadow, ADeltaAgainstAnotherVersionIsRefusedAndNothingIsApplied) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerChannel, shadow(true));
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  EXPECT_EQ(rank->engine->delta_base(), 0u) << "a new rank holds no version";
  ASSERT_OK(load_checkpoint(*rank->engine, w->checkpoint(), 1).status());
  EXPECT_EQ(rank->engine->delta_base(), 1u);
  const auto before = contents(rank->storage);

  ASSERT_OK(rank->engine->begin(3));
  bool applied = false;
  for (uint64_t wrong : {uint64_t{2}, uint64_t{0}, uint64_t{3}}) {
    const Status st = delta_on_first(*rank->engine, wrong, &applied);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << wrong << ": " << st.to_string();
    EXPECT_NE(st.message().find("refused"), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find("holds v1"), std::string::npos) << st.to_string();
  }
  EXPECT_FALSE(applied) << "a refused delta never reaches the values";
  EXPECT_TRUE(contents(rank->storage) == before) << "nor the storage";
  // The refused pieces covered nothing: the right base is still taken for the same region (its
  // layer, the embedding alone, completes and is written).
  ASSERT_OK(delta_on_first(*rank->engine, 1, &applied));
  EXPECT_TRUE(applied);
  EXPECT_FALSE(contents(rank->storage) == before);
  rank->engine->abort();
}

TEST(DeltaShadow, WithoutAShadowEveryDeltaIsRefused) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kNone, shadow(false));
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*rank->engine, w->checkpoint(), 1).status());
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  ASSERT_OK(rank->engine->begin(2));
  bool applied = false;
  const Status st = delta_on_first(*rank->engine, 1, &applied);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("FERRY_DELTA_SHADOW=off"), std::string::npos) << st.to_string();
  EXPECT_FALSE(applied);
}

TEST(DeltaShadow, AFailedRolledBackOrBypassedUpdateLeavesNoBase) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kInt4Group, shadow(true, RollbackMode::kHost));
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  ASSERT_EQ(rank->engine->delta_base(), 1u);
  // An update that ends incomplete, then is rolled back: storage holds v1 again, the shadow does not.
  ASSERT_OK(rank->engine->begin(2));
  bool applied = false;
  ASSERT_OK(delta_on_first(*rank->engine, 1, &applied));
  EXPECT_FALSE(rank->engine->finalize().ok());
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(rank->engine->version(), 1u);
  EXPECT_EQ(rank->engine->delta_base(), 0u) << "the shadow took the aborted update's delta";
  // A complete update gives it a base again; one whose pieces bypassed it does not.
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 3).status());
  EXPECT_EQ(rank->engine->delta_base(), 3u);
  ASSERT_OK(rank->engine->begin(4));
  rank->engine->drop_shadow();
  rank->engine->abort();
  ASSERT_OK(rank->engine->begin(5));
  rank->engine->drop_shadow();
  EXPECT_EQ(delta_on_first(*rank->engine, 3, &applied).code(), StatusCode::kFailedPrecondition)
      << "a shadow that missed pieces takes no delta";
}

}  // namespace
}  // namespace ferry::reload

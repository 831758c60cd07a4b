// Rank specs and manifests as peers send them: what from_wire refuses, and what the coordinator's
// start check (sharding::check_manifest) then makes of what it accepts.
#include "coordinator/wire.h"

#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sharding/planner.h"

namespace ferry::coordinator {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

void meta(wire::TensorMeta* t, const std::string& name, const Shape& shape) {
  t->set_name(name);
  t->set_dtype("bf16");
  for (int64_t d : shape) t->add_shape(d);
}

// One rank that takes rows [row, row + rows) of source "w" of shape {10, 4} into parameter "p".
wire::RankSpec rank(int64_t row, int64_t rows, const Shape& param_shape = {2, 4}) {
  wire::RankSpec w;
  w.set_tp_size(1);
  meta(w.add_expects(), "w", {10, 4});
  wire::Param* p = w.add_params();
  p->set_name("p");
  p->set_layer("model.norm");
  for (int64_t d : param_shape) p->add_shape(d);
  p->set_source_dtype("bf16");
  p->set_scheme("none");
  wire::Slice* s = p->add_slices();
  s->set_source("w");
  s->add_src_offset(row);
  s->add_src_offset(0);
  s->add_src_size(rows);
  s->add_src_size(4);
  s->add_dst_offset(0);
  s->add_dst_offset(0);
  return w;
}

Status start_check(const wire::RankSpec& w) {
  auto spec = from_wire(w);
  if (!spec.ok()) return spec.status();
  return sharding::check_manifest({{"w", DType::kBF16, {10, 4}}}, {*spec});
}

TEST(Wire, RankSpecRoundTripsAndPassesTheStartCheck) {
  auto spec = from_wire(rank(8, 2));
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  wire::RankSpec again;
  to_wire(*spec, &again);
  EXPECT_EQ(again.SerializeAsString(), rank(8, 2).SerializeAsString());
  EXPECT_TRUE(start_check(rank(8, 2)).ok());
  EXPECT_EQ(start_check(rank(9, 2)).code(), StatusCode::kOutOfRange);
}

// Found by fuzz/fuzz_handlers: offset + size overflowed in Region::inside, so a slice far outside
// its source passed the check (and was undefined behaviour).
TEST(Wire, SliceFarOutsideItsSourceFailsTheStartCheck) {
  Status st = start_check(rank(kMax, 1));
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("lies outside source w"));
  EXPECT_EQ(start_check(rank(kMax - 1, 2)).code(), StatusCode::kOutOfRange);
}

// Found by fuzz/fuzz_handlers: a parameter shape whose element count overflows int64 reached
// shape_numel in the start check.
TEST(Wire, ShapesThatOverflowOrGoNegativeAreRefused) {
  Status st = from_wire(rank(0, 2, {int64_t{1} << 62, 4})).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("p: shape"));
  EXPECT_EQ(from_wire(rank(0, 2, {2, -4})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(from_wire(rank(-1, 2)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(from_wire(rank(0, -2)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(from_wire(rank(0, 2, {0, kMax})).ok());  // no elements, however long

  wire::TensorMeta t;
  meta(&t, "w", {kMax, 2});
  st = from_wire(t).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("w: shape"));
  wire::StartUpdate s;
  meta(s.add_manifest(), "a", {4});
  meta(s.add_manifest(), "b", {-4});
  st = manifest_from_wire(s.manifest()).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("b: shape [-4] has a negative entry"));
}

}  // namespace
}  // namespace ferry::coordinator

#include "core/tensor.h"

#include <limits>

#include <gtest/gtest.h>

#include "core/rank_devices.h"

namespace ferry {
namespace {

Region box(Shape offset, Shape size) { return Region{std::move(offset), std::move(size)}; }

TEST(Shape, NumelStridesAndText) {
  EXPECT_EQ(shape_numel(Shape{}), 1);
  EXPECT_EQ(shape_numel(Shape{2, 3, 4}), 24);
  EXPECT_EQ(shape_numel(Dims{2, 0, 4}), 0);
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(contiguous_strides({}), Shape{});
  EXPECT_EQ(shape_to_string(Shape{4096, 128}), "[4096, 128]");
}

TEST(Region, OverlapsWhenBoxesShareAnElement) {
  const Region a = box({0, 0}, {4, 4});
  EXPECT_TRUE(a.overlaps(a));
  EXPECT_TRUE(a.overlaps(box({3, 3}, {2, 2})));
  EXPECT_TRUE(box({3, 3}, {2, 2}).overlaps(a));
  EXPECT_TRUE(a.overlaps(box({1, 1}, {1, 1})));   // inside
  EXPECT_TRUE(a.overlaps(box({-2, 1}, {10, 1})));  // crosses
}

TEST(Region, TouchingOrDisjointBoxesDoNotOverlap) {
  const Region a = box({0, 0}, {4, 4});
  EXPECT_FALSE(a.overlaps(box({4, 0}, {4, 4})));  // shares an edge only
  EXPECT_FALSE(a.overlaps(box({0, 4}, {4, 4})));
  EXPECT_FALSE(a.overlaps(box({4, 4}, {1, 1})));  // shares a corner only
  EXPECT_FALSE(a.overlaps(box({0, 5}, {4, 4})));
  EXPECT_FALSE(box({0, 4}, {4, 4}).overlaps(a));
  // Overlapping in one dimension is not enough.
  EXPECT_FALSE(box({0, 0}, {4, 2}).overlaps(box({0, 2}, {4, 2})));
}

TEST(Region, EmptyBoxesAndRankMismatchNeverOverlap) {
  EXPECT_FALSE(box({0, 0}, {4, 4}).overlaps(box({1, 1}, {0, 2})));
  EXPECT_FALSE(box({1, 1}, {2, 0}).overlaps(box({0, 0}, {4, 4})));
  EXPECT_FALSE(box({0}, {4}).overlaps(box({0, 0}, {4, 4})));
  EXPECT_TRUE(box({}, {}).overlaps(box({}, {})));  // two scalars: the same single element
}

TEST(Region, Inside) {
  const Shape shape{8, 6};
  EXPECT_TRUE(box({0, 0}, {8, 6}).inside(shape));
  EXPECT_TRUE(box({7, 5}, {1, 1}).inside(shape));
  EXPECT_TRUE(box({8, 0}, {0, 6}).inside(shape));  // empty box at the end
  EXPECT_FALSE(box({7, 5}, {2, 1}).inside(shape));
  EXPECT_FALSE(box({0, 1}, {8, 6}).inside(shape));
  EXPECT_FALSE(box({-1, 0}, {1, 1}).inside(shape));
  EXPECT_FALSE(box({0, 0}, {-1, 1}).inside(shape));
  EXPECT_FALSE(box({0}, {8}).inside(shape));
  EXPECT_FALSE(box({0, 0, 0}, {1, 1, 1}).inside(shape));
  EXPECT_FALSE(box({0}, {1, 1}).inside(shape));  // offset and size ranks differ
}

// Regions arrive from peers; a box far outside must not pass by overflowing offset + size.
TEST(Region, InsideDoesNotOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_FALSE(box({kMax, 0}, {1, 1}).inside({8, 6}));
  EXPECT_FALSE(box({1}, {kMax}).inside({kMax}));
  EXPECT_FALSE(box({kMax}, {kMax}).inside({kMax}));
  EXPECT_FALSE(box({0}, {1}).inside({-1}));
  EXPECT_TRUE(box({0}, {kMax}).inside({kMax}));
  EXPECT_TRUE(box({kMax - 1}, {1}).inside({kMax}));
  EXPECT_EQ(box({kMax, 2}, {1, 3}).to_string(), "[9223372036854775807:9223372036854775807+1, 2:5]");
}

TEST(Region, WholeAndText) {
  const Region w = Region::whole({8, 6});
  EXPECT_EQ(w, box({0, 0}, {8, 6}));
  EXPECT_EQ(w.numel(), 48);
  EXPECT_EQ(w.rank(), 2);
  EXPECT_TRUE(w.inside({8, 6}));
  EXPECT_EQ(box({0, 64}, {128, 32}).to_string(), "[0:128, 64:96]");
}

TEST(TensorView, Contiguity) {
  float data[24] = {};
  const TensorView c(data, DType::kF32, {2, 3, 4});
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(c.numel(), 24);
  EXPECT_EQ(c.nbytes(), 96u);
  EXPECT_EQ(c.rows(), 2);
  EXPECT_EQ(c.cols(), 12);
  // Transposed.
  EXPECT_FALSE(TensorView(data, DType::kF32, {4, 6}, {1, 4}, Device::cpu()).is_contiguous());
  // Row padding.
  EXPECT_FALSE(TensorView(data, DType::kF32, {2, 3}, {4, 1}, Device::cpu()).is_contiguous());
  // Dimensions of size 1 may have any stride.
  EXPECT_TRUE(TensorView(data, DType::kF32, {1, 6}, {99, 1}, Device::cpu()).is_contiguous());
  EXPECT_TRUE(TensorView(data, DType::kF32, {6, 1}, {1, 7}, Device::cpu()).is_contiguous());
  // A scalar and a vector.
  EXPECT_TRUE(TensorView(data, DType::kF32, {}).is_contiguous());
  EXPECT_EQ(TensorView(data, DType::kF32, {5}).cols(), 1);
}

TEST(TensorView, PackedInt4Bytes) {
  uint8_t data[4] = {};
  EXPECT_EQ(TensorView(data, DType::kI4Packed, {2, 4}).nbytes(), 4u);
  EXPECT_EQ(TensorView(data, DType::kI4Packed, {3}).nbytes(), 2u);
}

TEST(TensorView, Describe) {
  uint16_t data[4] = {};
  EXPECT_EQ(TensorView(data, DType::kBF16, {2, 2}).describe(), "bf16[2, 2] cpu");
  EXPECT_EQ(TensorView(data, DType::kF16, {4}, Device::cuda(1)).describe(), "f16[4] cuda:1");
}

TEST(TensorView, ExpectTensor) {
  float data[6] = {};
  const TensorView t(data, DType::kF32, {2, 3});
  EXPECT_TRUE(expect_tensor(t, "w", DType::kF32, {2, 3}).ok());
  Status s = expect_tensor(t, "w", DType::kBF16, {2, 3});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype f32 where bf16"), std::string::npos) << s.to_string();
  s = expect_tensor(t, "w", DType::kF32, {3, 2});
  EXPECT_NE(s.message().find("shape [2, 3] where [3, 2]"), std::string::npos) << s.to_string();
  s = expect_tensor(TensorView(data, DType::kF32, {2, 3}, {1, 2}, Device::cpu()), "w", DType::kF32, {2, 3});
  EXPECT_NE(s.message().find("contiguous"), std::string::npos) << s.to_string();
  s = expect_tensor(TensorView(nullptr, DType::kF32, {2, 3}), "w", DType::kF32, {2, 3});
  EXPECT_NE(s.message().find("null data"), std::string::npos) << s.to_string();
}


TEST(ParseRankDevices, OneForAllOrOnePerRank) {
  auto all = parse_rank_devices("cuda:1", 3);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(*all, (std::vector<Device>{Device::cuda(1), Device::cuda(1), Device::cuda(1)}));
  auto each = parse_rank_devices("cuda:1,cuda:2", 2);
  ASSERT_TRUE(each.ok()) << each.status().to_string();
  EXPECT_EQ(*each, (std::vector<Device>{Device::cuda(1), Device::cuda(2)}));
  auto cpu = parse_rank_devices("cpu", 1);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(*cpu, std::vector<Device>{Device::cpu()});
}

TEST(ParseRankDevices, WrongCountOrEntryNamesTheText) {
  auto n = parse_rank_devices("cuda:1,cuda:2", 4);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(n.status().message().find("2 given for 4 ranks"), std::string::npos) << n.status().message();
  auto bad = parse_rank_devices("cuda:1,gpu2", 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("gpu2"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(parse_rank_devices("cuda:1,", 2).ok());
}

}  // namespace
}  // namespace ferry

#include "core/buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

namespace ferry {
namespace {

TEST(Buffer, CpuAllocationIsAligned) {
  auto small = Buffer::allocate(100);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(small->size(), 100u);
  EXPECT_TRUE(small->device().is_cpu());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small->data()) % 64, 0u);
  auto large = Buffer::allocate(size_t{3} << 20);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large->data()) % 4096, 0u);
  std::memset(large->data(), 0xab, large->size());  // the whole size is usable
}

TEST(Buffer, ZeroClearsEveryByte) {
  auto b = Buffer::allocate(1000);
  ASSERT_TRUE(b.ok());
  std::memset(b->data(), 0xff, b->size());
  ASSERT_TRUE(b->zero().ok());
  for (size_t i = 0; i < b->size(); ++i) ASSERT_EQ(b->data_as<uint8_t>()[i], 0) << i;
}

TEST(Buffer, EmptyAllocation) {
  auto b = Buffer::allocate(0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->size(), 0u);
  EXPECT_TRUE(b->zero().ok());
  auto v = b->view(DType::kF32, {0, 4});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->numel(), 0);
}

TEST(Buffer, ViewWithinBounds) {
  auto b = Buffer::allocate(64);
  ASSERT_TRUE(b.ok());
  auto v = b->view(DType::kF32, {4, 4});
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(v->data(), b->data());
  EXPECT_EQ(v->shape(), (Shape{4, 4}));
  EXPECT_TRUE(v->is_contiguous());
  EXPECT_TRUE(b->view(DType::kBF16, {2, 8}).ok());   // a smaller view of the start
  EXPECT_TRUE(b->view(DType::kI4Packed, {128}).ok());  // 128 nibbles = 64 bytes
}

TEST(Buffer, ViewPastTheEndIsOutOfRange) {
  auto b = Buffer::allocate(64);
  ASSERT_TRUE(b.ok());
  auto v = b->view(DType::kF32, {4, 5});
  EXPECT_EQ(v.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(v.status().message().find("needs 80 bytes; buffer holds 64"), std::string::npos) << v.status().to_string();
  EXPECT_EQ(b->view(DType::kI4Packed, {129}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(b->view(DType::kI64, {9}).status().code(), StatusCode::kOutOfRange);
}

TEST(Buffer, MoveTransfersOwnership) {
  auto b = Buffer::allocate(32);
  ASSERT_TRUE(b.ok());
  void* p = b->data();
  Buffer moved = std::move(b).value();
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.size(), 32u);
  Buffer other;
  other = std::move(moved);
  EXPECT_EQ(other.data(), p);
  EXPECT_EQ(moved.data(), nullptr);  // NOLINT: checking the moved-from state
  EXPECT_EQ(moved.size(), 0u);
  other.reset();
  EXPECT_EQ(other.data(), nullptr);
  EXPECT_EQ(other.size(), 0u);
}

TEST(Buffer, CudaAllocation) {
  if (!cuda_device_available()) {
    auto b = Buffer::allocate(256, Device::cuda(0));
    EXPECT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().to_string();
    EXPECT_EQ(cuda_allocator(0).status().code(), StatusCode::kUnavailable);
    GTEST_SKIP() << "no CUDA device: allocation is Unavailable, as expected";
  }
  auto b = Buffer::allocate(256, Device::cuda(0));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_TRUE(b->device().is_cuda());
  EXPECT_EQ(b->device().index, 0);
  EXPECT_NE(b->data(), nullptr);
  EXPECT_TRUE(b->zero().ok());
  auto v = b->view(DType::kF16, {128});
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->device().is_cuda());
}

TEST(Buffer, PinnedAllocation) {
  auto a = pinned_allocator();
  if (!a.ok()) {
    EXPECT_EQ(a.status().code(), StatusCode::kUnavailable);
    GTEST_SKIP() << a.status().to_string();
  }
  auto b = Buffer::allocate(4096, **a);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_TRUE(b->device().is_cpu());
  std::memset(b->data(), 1, b->size());
  EXPECT_TRUE(b->zero().ok());
  EXPECT_EQ(b->data_as<uint8_t>()[4095], 0);
}

}  // namespace
}  // namespace ferry

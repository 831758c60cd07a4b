// gptq_int4 reload: permutation, repacked codes, scales, zeroed workspace; dequantize; bad g_idx.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/gptq.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/gptq_fixture.h"

namespace ferry::kernels::testing {
namespace {

struct Reloaded {
  std::vector<HostTensor> t;
  std::vector<TensorView> v;
};

Reloaded make_storage(int64_t n, int64_t k) {
  Reloaded r;
  auto layout = gptq_storage_layout({n, k});
  EXPECT_TRUE(layout.ok());
  for (const auto& s : *layout) r.t.push_back(empty_like(s.dtype, s.shape));
  for (auto& h : r.t) r.v.push_back(h.view());
  return r;
}

TEST(GptqTest, LayoutsNameEveryTensor) {
  auto st = storage_layout(Scheme::kGptqInt4, {300, 512}, {});
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->size(), 4u);
  EXPECT_EQ((*st)[0].suffix, "qweight");
  EXPECT_EQ((*st)[0].shape, (Shape{64, 300}));
  EXPECT_EQ((*st)[1].shape, (Shape{4, 300}));
  EXPECT_EQ((*st)[2].suffix, "perm");
  EXPECT_TRUE((*st)[2].runtime);
  EXPECT_EQ((*st)[3].suffix, "workspace");
  EXPECT_EQ((*st)[3].shape, (Shape{6}));  // 5 tile counters, then the GEMM's error flag
  EXPECT_TRUE((*st)[3].runtime);
  EXPECT_FALSE(storage_layout(Scheme::kGptqInt4, {300, 500}, {}).ok());
}

TEST(GptqTest, CpuReloadMatchesReference) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{70, 256}, {64, 128}, {129, 640}}) {
    GptqCheckpoint c = make_gptq(n, k, static_cast<uint64_t>(n * k));
    Reloaded r = make_storage(n, k);
    Status st = gptq_reload(c.qweight.view(), c.scales.view(), c.g_idx.view(), r.v);
    ASSERT_TRUE(st.ok()) << st.to_string();
    const auto perm = ref_perm(c);
    std::vector<int32_t> got_perm(static_cast<size_t>(k));
    std::memcpy(got_perm.data(), r.t[2].bytes.data(), got_perm.size() * 4);
    EXPECT_EQ(got_perm, perm);
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t col = 0; col < n; ++col) {
        uint32_t w;
        std::memcpy(&w, &r.t[0].bytes[static_cast<size_t>(((kk / 8) * n + col) * 4)], 4);
        const int32_t code = static_cast<int32_t>((w >> (4 * (kk % 8))) & 0xF);
        ASSERT_EQ(code, c.codes[static_cast<size_t>(perm[static_cast<size_t>(kk)] * n + col)]) << kk << "," << col;
      }
    }
    EXPECT_EQ(r.t[1].bytes, c.scales.bytes);
    for (uint8_t b : r.t[3].bytes) ASSERT_EQ(b, 0) << "workspace not zeroed";
    // Dequantized weight in logical order.
    HostTensor deq = empty_like(DType::kF32, {n, k});
    ASSERT_TRUE(dequantize(Scheme::kGptqInt4, r.v, {}, deq.view()).ok());
    const auto want = ref_gptq_weight(c);
    for (size_t i = 0; i < want.size(); ++i) {
      float v;
      std::memcpy(&v, &deq.bytes[i * 4], 4);
      ASSERT_EQ(static_cast<double>(v), static_cast<double>(static_cast<float>(want[i]))) << i;
    }
  }
}

TEST(GptqTest, BadGroupIndexIsRefused) {
  GptqCheckpoint c = make_gptq(16, 256, 7);
  Reloaded r = make_storage(16, 256);
  int32_t bad = 0;  // every entry group 0: group 0 holds 256 rows, group 1 none
  for (int64_t i = 0; i < 256; ++i) std::memcpy(&c.g_idx.bytes[static_cast<size_t>(i) * 4], &bad, 4);
  Status st = gptq_reload(c.qweight.view(), c.scales.view(), c.g_idx.view(), r.v);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("group 0 holds 256"), std::string::npos) << st.message();
  bad = 9;
  std::memcpy(&c.g_idx.bytes[0], &bad, 4);
  st = gptq_reload(c.qweight.view(), c.scales.view(), c.g_idx.view(), r.v);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("g_idx[0] = 9"), std::string::npos) << st.message();
  // Wrong scales shape.
  HostTensor scales = empty_like(DType::kF16, {3, 16});
  st = gptq_reload(c.qweight.view(), scales.view(), c.g_idx.view(), r.v);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("scales"), std::string::npos) << st.message();
}

TEST(GptqTest, CudaReloadMatchesCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  GptqCheckpoint c = make_gptq(200, 768, 11);
  Reloaded r = make_storage(200, 768);
  ASSERT_TRUE(gptq_reload(c.qweight.view(), c.scales.view(), c.g_idx.view(), r.v).ok());
  DeviceTensor q = to_device(c.qweight.bytes, DType::kI32, c.qweight.shape);
  DeviceTensor s = to_device(c.scales.bytes, DType::kF16, c.scales.shape);
  DeviceTensor g = to_device(c.g_idx.bytes, DType::kI32, c.g_idx.shape);
  std::vector<DeviceTensor> outs;
  std::vector<TensorView> views;
  for (auto& h : r.t) {
    outs.push_back(to_device(std::vector<uint8_t>(h.bytes.size(), 0x77), h.dtype, h.shape));
    views.push_back(outs.back().view);
  }
  Status st = gptq_reload(q.view, s.view, g.view, views);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (size_t i = 0; i < views.size(); ++i) EXPECT_EQ(to_host(views[i]), r.t[i].bytes) << "tensor " << i;
}

}  // namespace
}  // namespace ferry::kernels::testing

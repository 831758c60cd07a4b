// Bad input: every kernel entry point refuses it with a Status that names what was wrong.
#include <gtest/gtest.h>

#include "kernels/quantize.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

std::vector<HostTensor> outputs_for(Scheme s, const Shape& shape, std::vector<int64_t> shards = {}) {
  std::vector<HostTensor> out;
  auto layout = storage_layout(s, shape, shards);
  EXPECT_TRUE(layout.ok()) << layout.status().to_string();
  for (const auto& t : *layout) out.push_back(empty_like(t.dtype, t.shape));
  return out;
}

std::vector<TensorView> views(std::vector<HostTensor>& ts) {
  std::vector<TensorView> v;
  for (auto& t : ts) v.push_back(t.view());
  return v;
}

void expect_invalid(const Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "message: " << st.message() << " lacks: " << needle;
}

TEST(SchemeTest, NamesRoundTrip) {
  for (Scheme s : kAllSchemes) {
    auto p = parse_scheme(scheme_name(s));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, s);
  }
  expect_invalid(parse_scheme("fp4").status(), "unknown quantization scheme 'fp4'");
}

TEST(SchemeTest, StorageLayouts) {
  auto l = storage_layout(Scheme::kFp8Block, {300, 129}, {});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)[1].shape, (Shape{3, 2}));
  const int64_t shards[] = {64, 16, 16};
  l = storage_layout(Scheme::kFp8PerTensor, {96, 64}, shards);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)[0].dtype, DType::kF8E4M3FN);
  EXPECT_EQ((*l)[1].shape, (Shape{3}));
  l = storage_layout(Scheme::kNone, {4, 4}, {}, DType::kF16);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->size(), 1u);
  EXPECT_EQ((*l)[0].dtype, DType::kF16);
  l = storage_layout(Scheme::kInt4Group, {4, 256}, {});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)[0].dtype, DType::kI4Packed);
  EXPECT_EQ((*l)[1].shape, (Shape{4, 2}));
  expect_invalid(storage_layout(Scheme::kInt4Group, {4, 200}, {}).status(), "divisible by 128");
  expect_invalid(storage_layout(Scheme::kNone, {4, 4}, {}, DType::kI8).status(), "not i8");
  const int64_t bad_shards[] = {64, 16};
  expect_invalid(storage_layout(Scheme::kFp8PerTensor, {96, 64}, bad_shards).status(), "sum to 80");
  // Fused experts (gate and up halves of each matrix) under ferry's per-tensor layout: refused with
  // the reason, not as shards that fail to sum to the expert count.
  const std::vector<int64_t> halves = {512, 512};
  expect_invalid(storage_layout(Scheme::kFp8PerTensor, {4, 1024, 256}, halves).status(), "vllm or sglang layout");
}

TEST(BadInputTest, QuantizeRefusesWrongInputs) {
  HostTensor in = make_input(DType::kF32, {8, 128}, 1);
  auto outs = outputs_for(Scheme::kFp8PerChannel, {8, 128});
  auto v = views(outs);
  // Input dtype.
  HostTensor i8 = empty_like(DType::kI8, {8, 128});
  expect_invalid(quantize(Scheme::kFp8PerChannel, i8.view(), {}, v), "dtype i8");
  // Non-contiguous input.
  TensorView strided(in.bytes.data(), DType::kF32, {8, 64}, {128, 2}, Device::cpu());
  expect_invalid(quantize(Scheme::kFp8PerChannel, strided, {}, v), "contiguous");
  // Wrong output dtype, shape, count.
  auto wrong = outputs_for(Scheme::kInt8PerChannel, {8, 128});
  expect_invalid(quantize(Scheme::kFp8PerChannel, in.view(), {}, views(wrong)), "'weight': dtype i8");
  auto small = outputs_for(Scheme::kFp8PerChannel, {4, 128});
  expect_invalid(quantize(Scheme::kFp8PerChannel, in.view(), {}, views(small)), "'weight': shape [4, 128]");
  expect_invalid(quantize(Scheme::kFp8PerChannel, in.view(), {}, std::span<const TensorView>(v).first(1)),
                 "1 tensors given where the layout has 2");
  // Non-contiguous output.
  std::vector<TensorView> nc = v;
  nc[0] = TensorView(outs[0].bytes.data(), DType::kF8E4M3FN, {8, 128}, {1, 8}, Device::cpu());
  expect_invalid(quantize(Scheme::kFp8PerChannel, in.view(), {}, nc), "contiguous");
  // Group size broken.
  HostTensor odd = make_input(DType::kF32, {8, 100}, 2);
  expect_invalid(quantize(Scheme::kInt4Group, odd.view(), {}, v), "divisible by 128");
  // gptq is not an online scheme.
  expect_invalid(quantize(Scheme::kGptqInt4, in.view(), {}, v), "gptq_reload");
  // Shards that do not cover the rows.
  auto pt = outputs_for(Scheme::kFp8PerTensor, {8, 128});
  const int64_t shards[] = {3, 3};
  expect_invalid(quantize(Scheme::kFp8PerTensor, in.view(), shards, views(pt)), "sum to 6 rows but the tensor has 8");
  // Mixed devices.
  std::vector<TensorView> mixed = v;
  mixed[1] = TensorView(outs[1].bytes.data(), DType::kF32, {8}, Device::cuda(0));
  expect_invalid(quantize(Scheme::kFp8PerChannel, in.view(), {}, mixed), "on cuda:0");
}

TEST(BadInputTest, DequantizeRefusesWrongStorage) {
  auto outs = outputs_for(Scheme::kFp8Block, {130, 130});
  HostTensor y = empty_like(DType::kF32, {130, 130});
  HostTensor y16 = empty_like(DType::kBF16, {130, 130});
  expect_invalid(dequantize(Scheme::kFp8Block, views(outs), {}, y16.view()), "dtype bf16");
  HostTensor ybig = empty_like(DType::kF32, {260, 130});
  expect_invalid(dequantize(Scheme::kFp8Block, views(outs), {}, ybig.view()), "shape");
  EXPECT_TRUE(dequantize(Scheme::kFp8Block, views(outs), {}, y.view()).ok());
}

TEST(BadInputTest, CudaViewsWithoutCudaAreUnavailable) {
#if defined(FERRY_HAVE_CUDA)
  GTEST_SKIP() << "built with CUDA";
#else
  HostTensor in = make_input(DType::kF32, {2, 16}, 3);
  auto outs = outputs_for(Scheme::kNone, {2, 16});
  TensorView din(in.bytes.data(), DType::kF32, {2, 16}, Device::cuda(0));
  TensorView dout(outs[0].bytes.data(), DType::kBF16, {2, 16}, Device::cuda(0));
  const TensorView o[] = {dout};
  EXPECT_EQ(quantize(Scheme::kNone, din, {}, o).code(), StatusCode::kUnavailable);
#endif
}

}  // namespace
}  // namespace ferry::kernels::testing

// gptq_int4 in the vLLM and SGLang layouts: an act-order GPTQ checkpoint repacked as Marlin reads
// it, on the CPU and on CUDA, bit for bit against vLLM's definitions step by step
// (MarlinLinearKernel.process_weights_after_loading: marlin_sort_g_idx, gptq_marlin_repack with
// perm = g_idx_sort_indices, whose reference is marlin_weights of the sorted codes;
// marlin_permute_scales of the scales in the model's dtype).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/gptq.h"
#include "tests/kernels/gptq_fixture.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/marlin_reference.h"

namespace ferry::kernels::testing {
namespace {

// The four tensors vLLM holds after loading, as bytes: qweight, scales, g_idx, g_idx_sort_indices.
std::vector<std::vector<uint8_t>> vllm_reference(const GptqCheckpoint& c, DType model) {
  const auto perm = ref_perm(c);  // torch.argsort of g_idx, stable (every group holds 128 rows)
  std::vector<uint32_t> q(static_cast<size_t>(c.k * c.n));
  for (int64_t k = 0; k < c.k; ++k) {
    for (int64_t n = 0; n < c.n; ++n) {
      q[static_cast<size_t>(k * c.n + n)] =
          static_cast<uint32_t>(c.codes[static_cast<size_t>(perm[static_cast<size_t>(k)] * c.n + n)]);
    }
  }
  const auto words = vllm_marlin_weights(q, c.k, c.n);
  std::vector<uint16_t> s(static_cast<size_t>(c.k / 128 * c.n));
  for (size_t i = 0; i < s.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &c.scales.bytes[i * 2], 2);
    // The checkpoint's f16 copied into a params_dtype parameter: torch's conversion, nearest even.
    s[i] = model == DType::kBF16 ? testref::encode_bf16(testref::decode_f16(h)) : h;
  }
  const auto scales = vllm_permute_scales(s, c.k);
  std::vector<int32_t> g(static_cast<size_t>(c.k)), sorted(static_cast<size_t>(c.k));
  std::memcpy(g.data(), c.g_idx.bytes.data(), g.size() * 4);
  for (size_t i = 0; i < g.size(); ++i) sorted[i] = g[static_cast<size_t>(perm[i])];
  auto bytes = [](const auto& v) {
    std::vector<uint8_t> b(v.size() * sizeof(v[0]));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  return {bytes(words), bytes(scales), bytes(sorted), bytes(perm)};
}

std::vector<std::vector<uint8_t>> reload(EngineLayout layout, GptqCheckpoint& c, DType model, bool cuda) {
  auto layout_t = storage_layout(Scheme::kGptqInt4, layout, {c.n, c.k}, {}, model);
  EXPECT_TRUE(layout_t.ok()) << layout_t.status().to_string();
  if (!layout_t.ok()) return {};
  if (!cuda) {
    std::vector<HostTensor> t;
    std::vector<TensorView> v;
    for (const auto& s : *layout_t) t.push_back(empty_like(s.dtype, s.shape));
    for (auto& h : t) v.push_back(h.view());
    const Status st = gptq_reload(layout, c.qweight.view(), c.scales.view(), c.g_idx.view(), v);
    EXPECT_TRUE(st.ok()) << st.to_string();
    std::vector<std::vector<uint8_t>> out;
    for (auto& h : t) out.push_back(h.bytes);
    return out;
  }
  DeviceTensor q = to_device(c.qweight.bytes, DType::kI32, c.qweight.shape);
  DeviceTensor s = to_device(c.scales.bytes, DType::kF16, c.scales.shape);
  DeviceTensor g = to_device(c.g_idx.bytes, DType::kI32, c.g_idx.shape);
  std::vector<DeviceTensor> outs;
  std::vector<TensorView> views;
  for (const auto& t : *layout_t) outs.push_back(device_output(t.dtype, t.shape));
  for (auto& t : outs) views.push_back(t.view);
  const Status st = gptq_reload(layout, q.view, s.view, g.view, views);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<std::vector<uint8_t>> out;
  for (auto& t : outs) out.push_back(to_host(t.view));
  return out;
}

void expect_matches(bool cuda) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 128}, {192, 512}, {128, 384}};
  for (const auto& [n, k] : shapes) {
    for (DType model : {DType::kBF16, DType::kF16}) {
      for (EngineLayout layout : {EngineLayout::kVllm, EngineLayout::kSglang}) {
        GptqCheckpoint c = make_gptq(n, k, static_cast<uint64_t>(n * 1000 + k));
        const auto want = vllm_reference(c, model);
        const auto got = reload(layout, c, model, cuda);
        ASSERT_EQ(got.size(), 4u);
        const char* names[] = {"qweight", "scales", "g_idx", "g_idx_sort_indices"};
        for (size_t i = 0; i < 4; ++i) {
          EXPECT_EQ(got[i], want[i]) << fmt::format("[{}, {}] {} {} {} {}", n, k, engine_layout_name(layout),
                                                    dtype_name(model), cuda ? "cuda" : "cpu", names[i]);
        }
      }
    }
  }
}

TEST(GptqMarlin, CpuMatchesVllmsRepack) { expect_matches(false); }

TEST(GptqMarlin, CudaMatchesVllmsRepack) {
  FERRY_SKIP_WITHOUT_GPU();
  expect_matches(true);
}

TEST(GptqMarlin, NamesAndRefusals) {
  auto t = storage_layout(Scheme::kGptqInt4, EngineLayout::kVllm, {192, 512}, {}, DType::kBF16);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  std::string names;
  for (const auto& x : *t) names += x.suffix + ":" + std::string(dtype_name(x.dtype)) + shape_to_string(x.shape) + " ";
  EXPECT_EQ(names, "qweight:i32[32, 384] scales:bf16[4, 192] g_idx:i32[512] g_idx_sort_indices:i32[512] ");
  auto narrow = storage_layout(Scheme::kGptqInt4, EngineLayout::kSglang, {96, 256}, {}, DType::kBF16);
  ASSERT_FALSE(narrow.ok());
  EXPECT_NE(narrow.status().message().find("multiple of 64"), std::string::npos) << narrow.status().to_string();
  // gptq_int4 is a reload, in any layout.
  HostTensor in = make_input(DType::kBF16, {64, 128}, 1);
  std::vector<HostTensor> o;
  std::vector<TensorView> v;
  const auto small = storage_layout(Scheme::kGptqInt4, EngineLayout::kVllm, {64, 128}, {}, DType::kBF16);
  ASSERT_TRUE(small.ok());
  for (const auto& s : *small) o.push_back(empty_like(s.dtype, s.shape));
  for (auto& h : o) v.push_back(h.view());
  const Status st = quantize(Scheme::kGptqInt4, EngineLayout::kVllm, in.view(), {}, v);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("gptq_reload"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace ferry::kernels::testing

// int4_group in the vLLM and SGLang layouts: Marlin's repacked weight and permuted scales, on the CPU
// and on CUDA, bit for bit against a reference written here step by step from vLLM's definitions
// (marlin_utils_test.py get_weight_perm / marlin_permute_weights / marlin_weights, marlin_utils.py
// get_scale_perms / marlin_permute_scales): lists built as vLLM builds them, the reshape and
// permute done on explicit index arrays, not ferry's closed-form positions.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/quantize.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/marlin_reference.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

// ferry's int4_group arithmetic with the scale held in `scale_dtype`: amax / 7 rounded to it (1 when
// 0, its largest finite when it overflows), codes clamp(round(x / s), -8, 7) stored as uint4b8
// (code + 8), the weight viewed as Marlin's q_w [K, N].
struct Ref {
  std::vector<uint32_t> words;
  std::vector<uint16_t> scales;
};
Ref reference(const HostTensor& in, int64_t batch, int64_t n, int64_t k, DType scale_dtype) {
  const bool bf16 = scale_dtype == DType::kBF16;
  const int64_t groups = k / 128;
  Ref r;
  for (int64_t m = 0; m < batch; ++m) {
    const float* x = in.values.data() + m * n * k;
    std::vector<uint16_t> s(static_cast<size_t>(groups * n));
    std::vector<uint32_t> q(static_cast<size_t>(k * n));
    for (int64_t row = 0; row < n; ++row) {
      for (int64_t g = 0; g < groups; ++g) {
        const float amax7 = testref::f32_div(testref::amax_finite(x + row * k + g * 128, 128), 7.0f);
        uint16_t h = bf16 ? testref::encode_bf16(amax7) : testref::encode_f16(amax7);
        if (h == 0) h = bf16 ? 0x3F80 : 0x3C00;
        if (h >= (bf16 ? 0x7F80 : 0x7C00)) h = bf16 ? 0x7F7F : 0x7BFF;
        s[static_cast<size_t>(g * n + row)] = h;
        const float scale = static_cast<float>(bf16 ? testref::decode_bf16(h) : testref::decode_f16(h));
        for (int64_t c = g * 128; c < g * 128 + 128; ++c) {
          q[static_cast<size_t>(c * n + row)] =
              static_cast<uint32_t>(testref::ref_quant_int(x[row * k + c], scale, -8, 7) + 8);
        }
      }
    }
    const auto w = vllm_marlin_weights(q, k, n);
    const auto ps = vllm_permute_scales(s, k);
    r.words.insert(r.words.end(), w.begin(), w.end());
    r.scales.insert(r.scales.end(), ps.begin(), ps.end());
  }
  return r;
}

struct Case {
  Shape shape;
  EngineLayout layout;
};

std::vector<std::vector<uint8_t>> run(const Case& c, HostTensor& in, DType scale_dtype, bool cuda) {
  auto layout = storage_layout(Scheme::kInt4Group, c.layout, c.shape, {}, scale_dtype);
  EXPECT_TRUE(layout.ok()) << layout.status().to_string();
  if (!layout.ok()) return {};
  return quantize_bytes(Scheme::kInt4Group, c.layout, in, {}, *layout, cuda);
}

class MarlinTest : public ::testing::TestWithParam<Case> {};

void expect_matches(const Case& c, bool cuda) {
  const bool stacked = c.shape.size() == 3;
  const int64_t batch = stacked ? c.shape[0] : 1, n = c.shape[stacked ? 1 : 0], k = c.shape[stacked ? 2 : 1];
  for (DType in_dtype : {DType::kBF16, DType::kF32, DType::kF16}) {
    for (DType scale_dtype : {DType::kBF16, DType::kF16}) {
      for (uint64_t seed : {3u, 101u}) {  // make_input's adversarial rows (NaN, inf, ties), tile_input's finite tiles
        HostTensor in = seed < 100 ? make_input(in_dtype, c.shape, seed) : tile_input(in_dtype, c.shape, seed);
        const Ref want = reference(in, batch, n, k, scale_dtype);
        const auto got = run(c, in, scale_dtype, cuda);
        ASSERT_EQ(got.size(), 2u);
        SCOPED_TRACE(fmt::format("{} {} in {} scales {} seed {}", shape_to_string(c.shape), cuda ? "cuda" : "cpu",
                                 dtype_name(in_dtype), dtype_name(scale_dtype), seed));
        ASSERT_EQ(got[0].size(), want.words.size() * 4);
        ASSERT_EQ(got[1].size(), want.scales.size() * 2);
        for (size_t i = 0; i < want.scales.size(); ++i) {
          uint16_t g;
          std::memcpy(&g, &got[1][i * 2], 2);
          ASSERT_EQ(g, want.scales[i]) << "scale " << i;
        }
        for (size_t i = 0; i < want.words.size(); ++i) {
          uint32_t g;
          std::memcpy(&g, &got[0][i * 4], 4);
          ASSERT_EQ(g, want.words[i]) << fmt::format("word {}: 0x{:08x}, want 0x{:08x}", i, g, want.words[i]);
        }
      }
    }
  }
}

TEST_P(MarlinTest, CpuMatchesVllmsRepack) { expect_matches(GetParam(), false); }

TEST_P(MarlinTest, CudaMatchesVllmsRepack) {
  FERRY_SKIP_WITHOUT_GPU();
  expect_matches(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MarlinTest,
                         ::testing::Values(Case{{64, 128}, EngineLayout::kVllm},  // one group: scale_perm_single
                                           Case{{192, 384},
                                                EngineLayout::kVllm},  // three groups, three 64-column tiles
                                           Case{{128, 256}, EngineLayout::kSglang},
                                           Case{{3, 64, 256}, EngineLayout::kVllm}),  // stacked experts, each repacked
                         [](const auto& info) {
                           std::string n = std::string(engine_layout_name(info.param.layout));
                           for (int64_t d : info.param.shape) n += "_" + std::to_string(d);
                           return n;
                         });

// Runs of whole 64-output chunks (a fused qkv's q, k and v arriving apart), and matrices of a stacked
// weight one at a time, write what the whole parameter's quantize() does; other runs are refused.
TEST(MarlinLayout, RowRunsWriteWhatTheWholeWeightDoes) {
  for (const Shape& shape : {Shape{192, 256}, Shape{3, 64, 256}}) {
    HostTensor in = make_input(DType::kBF16, shape, 9);
    auto layout = storage_layout(Scheme::kInt4Group, EngineLayout::kVllm, shape, {}, DType::kBF16);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    Outputs whole = make_outputs(*layout), runs = make_outputs(*layout);
    ASSERT_TRUE(quantize(Scheme::kInt4Group, EngineLayout::kVllm, in.view(), {}, whole.views).ok());
    const int64_t per_row = static_cast<int64_t>(in.values.size()) / shape[0];
    const std::vector<std::pair<int64_t, int64_t>> cuts =
        shape.size() == 2 ? std::vector<std::pair<int64_t, int64_t>>{{128, 64}, {0, 128}}
                          : std::vector<std::pair<int64_t, int64_t>>{{2, 1}, {0, 2}};
    for (const auto& [row0, rows] : cuts) {
      Shape part = shape;
      part[0] = rows;
      const TensorView v(in.bytes.data() + row0 * per_row * 2, DType::kBF16, part);
      const Status st = quantize_marlin_rows(EngineLayout::kVllm, shape, v, row0, runs.views);
      ASSERT_TRUE(st.ok()) << st.to_string();
    }
    EXPECT_EQ(runs.bytes(), whole.bytes()) << shape_to_string(shape);
    if (::ferry::cuda_device_available()) {  // the same runs on CUDA, against the CPU's whole weight
      std::vector<DeviceTensor> outs;
      std::vector<TensorView> views;
      for (const auto& t : *layout) outs.push_back(device_output(t.dtype, t.shape));
      for (auto& t : outs) views.push_back(t.view);
      for (const auto& [row0, rows] : cuts) {
        Shape part = shape;
        part[0] = rows;
        const std::vector<uint8_t> bytes(in.bytes.begin() + row0 * per_row * 2,
                                         in.bytes.begin() + (row0 + rows) * per_row * 2);
        DeviceTensor d = to_device(bytes, DType::kBF16, part);
        const Status st = quantize_marlin_rows(EngineLayout::kVllm, shape, d.view, row0, views);
        ASSERT_TRUE(st.ok()) << st.to_string();
        (void)to_host(d.view);  // synchronizes before d is freed
      }
      const auto want = whole.bytes();
      for (size_t i = 0; i < outs.size(); ++i) EXPECT_EQ(to_host(outs[i].view), want[i]) << "cuda tensor " << i;
    }
    if (shape.size() == 2) {
      const TensorView v(in.bytes.data() + 32 * per_row * 2, DType::kBF16, {64, 256});
      const Status st = quantize_marlin_rows(EngineLayout::kVllm, shape, v, 32, runs.views);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("64-output chunks"), std::string::npos) << st.to_string();
    }
  }
}

TEST(MarlinLayout, NamesAndShapes) {
  auto names = [](const Shape& shape, DType model) {
    auto t = storage_layout(Scheme::kInt4Group, EngineLayout::kVllm, shape, {}, model);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    std::string out;
    for (const auto& x : *t) out += x.suffix + ":" + std::string(dtype_name(x.dtype)) + shape_to_string(x.shape) + " ";
    return out;
  };
  EXPECT_EQ(names({192, 384}, DType::kBF16), "weight_packed:i32[24, 384] weight_scale:bf16[3, 192] ");
  EXPECT_EQ(names({4, 128, 256}, DType::kF16), "weight_packed:i32[4, 16, 256] weight_scale:f16[4, 2, 128] ");
}

TEST(MarlinLayout, ShapesMarlinCannotTileAreRefusedSayingWhy) {
  auto refused = [](const Shape& shape, DType model, const std::string& why) {
    auto t = storage_layout(Scheme::kInt4Group, EngineLayout::kSglang, shape, {}, model);
    ASSERT_FALSE(t.ok()) << shape_to_string(shape);
    EXPECT_NE(t.status().message().find(why), std::string::npos) << t.status().to_string();
    EXPECT_NE(t.status().message().find("sglang layout"), std::string::npos) << t.status().to_string();
  };
  refused({96, 128}, DType::kBF16, "multiple of 64");
  refused({64, 192}, DType::kBF16, "multiple of 128");
  refused({64, 128}, DType::kF32, "bf16 or f16");
  // The scales' dtype is checked against the outputs given: f32 scales are refused.
  HostTensor in = make_input(DType::kBF16, {64, 128}, 5);
  Outputs o =
      make_outputs({{"weight_packed", DType::kI32, {8, 128}, false}, {"weight_scale", DType::kF32, {1, 64}, false}});
  const Status st = quantize(Scheme::kInt4Group, EngineLayout::kVllm, in.view(), {}, o.views);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("bf16 or f16"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace ferry::kernels::testing

// Engine layouts (kernels/quantize.h "Engine layouts"): the storage names and shapes of vLLM's and
// SGLang's parameters, and their fp8 arithmetic, on the CPU and on CUDA, bit for bit against
// references written here from the engines' definitions (docs/engines.md cites each). The inputs
// are make_input()'s adversarial rows: zeros, NaN and inf, subnormals, huge values, e4m3 ties.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/quantize.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/ref_quantize.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

using testref::f32_div;
using testref::f32_mul;

// An engine's fp8 code of a quotient or product `v`: e4m3 nearest even with saturation, NaN as the
// engine leaves it (0x7E where CUDA's fminf/fmaxf clamp turns NaN into +448).
uint8_t engine_code(double v, uint8_t nan_code) { return std::isnan(v) ? nan_code : testref::encode_e4m3(v); }

struct Ref {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// vLLM scaled_fp8_quant over elements [0, n): scale = amax / 448, no zero guard, codes of x * (1 / s).
void scaled_fp8_quant(const float* x, int64_t n, uint8_t* out, float* scale) {
  const float s = f32_div(testref::amax_finite(x, n), 448.0f);
  const float inv = f32_div(1.0f, s);
  for (int64_t i = 0; i < n; ++i) out[i] = engine_code(f32_mul(x[i], inv), 0x7E);
  *scale = s;
}

// The expected codes and scales (in storage order) of one engine scheme over `in`, viewed as
// `batch` matrices of rows x cols.
Ref reference(EngineLayout layout, Scheme scheme, const HostTensor& in, int64_t batch) {
  const int64_t mrows = in.shape.size() >= 3 ? in.shape[1] : in.shape[0];
  const int64_t cols = static_cast<int64_t>(in.values.size()) / (batch * mrows);
  const float* x = in.values.data();
  Ref r;
  r.codes.resize(in.values.size());
  switch (scheme) {
    case Scheme::kFp8PerTensor:
      r.scales.resize(static_cast<size_t>(batch));
      for (int64_t e = 0; e < batch; ++e) {
        scaled_fp8_quant(x + e * mrows * cols, mrows * cols, r.codes.data() + e * mrows * cols,
                         &r.scales[static_cast<size_t>(e)]);
      }
      break;
    case Scheme::kFp8PerChannel:
      for (int64_t row = 0; row < mrows; ++row) {
        const float* xr = x + row * cols;
        const float m = testref::amax_finite(xr, cols);
        float s;
        if (layout == EngineLayout::kVllm) {  // _fp8_channel_scale: clamped to 1 / (448 * 512)
          s = std::max(f32_div(m, 448.0f), f32_div(1.0f, 229376.0f));
          for (int64_t c = 0; c < cols; ++c) r.codes[row * cols + c] = engine_code(f32_div(xr[c], s), 0x7F);
        } else {  // per_token_quant_fp8: a zero scale multiplies by 0
          s = f32_div(m, 448.0f);
          const float inv = s == 0.0f ? 0.0f : f32_div(1.0f, s);
          for (int64_t c = 0; c < cols; ++c) r.codes[row * cols + c] = engine_code(f32_mul(xr[c], inv), 0x7E);
        }
        r.scales.push_back(s);
      }
      break;
    case Scheme::kFp8Block: {  // per_block_cast_to_fp8, bands restarting at every stacked matrix
      const int64_t bands = (mrows + 127) / 128, bcols = (cols + 127) / 128;
      for (int64_t e = 0; e < batch; ++e) {
        for (int64_t b = 0; b < bands; ++b) {
          for (int64_t bc = 0; bc < bcols; ++bc) {
            const int64_t r0 = e * mrows + b * 128, r1 = std::min(e * mrows + mrows, r0 + 128);
            const int64_t c0 = bc * 128, c1 = std::min(cols, c0 + 128);
            float m = 0;
            for (int64_t row = r0; row < r1; ++row) m = std::max(m, testref::amax_finite(x + row * cols + c0, c1 - c0));
            const float s = f32_div(std::max(m, 1e-4f), 448.0f);
            const float inv = f32_div(1.0f, s);
            for (int64_t row = r0; row < r1; ++row) {
              for (int64_t c = c0; c < c1; ++c) r.codes[row * cols + c] = engine_code(f32_mul(x[row * cols + c], inv), 0x7F);
            }
            r.scales.push_back(s);
          }
        }
      }
      break;
    }
    default: ADD_FAILURE() << "no reference for " << scheme_name(scheme);
  }
  return r;
}

struct Case {
  EngineLayout layout;
  Scheme scheme;
  Shape shape;
  std::vector<int64_t> shard_rows;
  std::string name;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](EngineLayout l, Scheme s, Shape shape, std::vector<int64_t> shards) {
    std::string n = std::string(engine_layout_name(l)) + "_" + std::string(scheme_name(s));
    for (int64_t d : shape) n += "_" + std::to_string(d);
    out.push_back({l, s, std::move(shape), std::move(shards), n});
  };
  for (EngineLayout l : {EngineLayout::kVllm, EngineLayout::kSglang}) {
    add(l, Scheme::kFp8PerChannel, {40, 200}, {});
    add(l, Scheme::kFp8PerChannel, {24, 4096}, {8, 8, 8});
    add(l, Scheme::kFp8PerChannel, {8, 14336}, {});  // a down_proj row: the row kernels' longest instance
    add(l, Scheme::kFp8Block, {300, 260}, {});
    add(l, Scheme::kFp8Block, {3, 256, 136}, {128, 128});  // stacked experts, gate and up
    add(l, Scheme::kFp8PerTensor, {4, 48, 64}, {24, 24});   // one scale per expert
  }
  add(EngineLayout::kVllm, Scheme::kFp8PerTensor, {96, 200}, {64, 16, 16});  // fused qkv: one scale
  add(EngineLayout::kVllm, Scheme::kFp8PerTensor, {20, 4096}, {});
  add(EngineLayout::kVllm, Scheme::kFp8PerTensor, {80, 16, 40}, {8, 8});  // more experts than shards a kernel takes
  return out;
}

class EngineLayoutTest : public ::testing::TestWithParam<Case> {};

// The kernels' outputs on `device` (cpu, or cuda when one is here) for the case's input.
std::vector<std::vector<uint8_t>> run(const Case& c, HostTensor& in, bool cuda) {
  auto layout = storage_layout(c.scheme, c.layout, c.shape, c.shard_rows);
  EXPECT_TRUE(layout.ok()) << layout.status().to_string();
  if (!layout.ok()) return {};
  return quantize_bytes(c.scheme, c.layout, in, c.shard_rows, *layout, cuda);
}

void expect_matches(const Case& c, bool cuda) {
  for (DType dt : {DType::kBF16, DType::kF32, DType::kF16}) {
    for (uint64_t seed : {1u, 7u, 101u, 102u}) {  // make_input's adversarial rows, then tile_input's finite tiles
      HostTensor in = seed < 100 ? make_input(dt, c.shape, seed) : tile_input(dt, c.shape, seed);
      const int64_t batch = c.shape.size() >= 3 ? c.shape[0] : 1;
      const Ref want = reference(c.layout, c.scheme, in, batch);
      const auto got = run(c, in, cuda);
      ASSERT_EQ(got.size(), 2u);
      const std::string where = c.name + (cuda ? " cuda " : " cpu ") + std::string(dtype_name(dt)) + " seed " +
                                std::to_string(seed);
      ASSERT_EQ(got[1].size(), want.scales.size() * 4) << where;
      for (size_t i = 0; i < want.scales.size(); ++i) {
        float g;
        std::memcpy(&g, &got[1][i * 4], 4);
        ASSERT_EQ(std::memcmp(&g, &want.scales[i], 4), 0) << where << ": scale " << i << " " << g << " want "
                                                          << want.scales[i];
      }
      for (size_t i = 0; i < want.codes.size(); ++i) {
        ASSERT_EQ(got[0][i], want.codes[i]) << where << ": code " << i << " of x = " << in.values[i];
      }
    }
  }
}

TEST_P(EngineLayoutTest, CpuMatchesTheEnginesDefinition) { expect_matches(GetParam(), false); }

TEST_P(EngineLayoutTest, CudaMatchesTheEnginesDefinition) {
  FERRY_SKIP_WITHOUT_GPU();
  expect_matches(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineLayoutTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// vLLM's per-tensor rule on shards whose amax is 0 (all zeros, all infinities): its scale is then
// 0 (no guard), its multiplier 1 / 0, and every code the NaN code of 0 * inf or the clamp of inf.
TEST(EngineLayoutEdges, VllmPerTensorOfZerosAndInfinitiesMatchesTheDefinition) {
  const Case c{EngineLayout::kVllm, Scheme::kFp8PerTensor, {20, 4096}, {}, "vllm_fp8_per_tensor_edges"};
  for (const uint16_t bits : {uint16_t{0x0000}, uint16_t{0x7F80}, uint16_t{0xFF80}}) {
    HostTensor in = make_input(DType::kBF16, c.shape, 1);
    for (size_t i = 0; i < in.values.size(); ++i) {
      std::memcpy(in.bytes.data() + 2 * i, &bits, 2);
      in.values[i] = static_cast<float>(testref::decode_bf16(bits));
    }
    const Ref want = reference(c.layout, c.scheme, in, 1);
    for (const bool cuda : {false, true}) {
      if (cuda && !::ferry::cuda_device_available()) continue;
      const auto got = run(c, in, cuda);
      ASSERT_EQ(got.size(), 2u);
      SCOPED_TRACE(fmt::format("bf16 0x{:04x} {}", bits, cuda ? "cuda" : "cpu"));
      ASSERT_EQ(std::memcmp(got[1].data(), want.scales.data(), 4), 0);
      for (size_t i = 0; i < want.codes.size(); ++i) ASSERT_EQ(got[0][i], want.codes[i]) << "code " << i;
    }
  }
}

TEST(EngineLayouts, NamesAndShapes) {
  auto shapes = [](Scheme s, EngineLayout l, Shape shape, std::vector<int64_t> shards = {}) {
    auto t = storage_layout(s, l, shape, shards);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    std::string out;
    for (const auto& x : *t) out += x.suffix + ":" + std::string(dtype_name(x.dtype)) + shape_to_string(x.shape) + " ";
    return out;
  };
  EXPECT_EQ(shapes(Scheme::kFp8PerTensor, EngineLayout::kVllm, {96, 64}, {64, 16, 16}),
            "weight:f8_e4m3fn[96, 64] weight_scale:f32[1] ");
  EXPECT_EQ(shapes(Scheme::kFp8PerTensor, EngineLayout::kFerry, {96, 64}, {64, 16, 16}),
            "weight:f8_e4m3fn[96, 64] weight_scale:f32[3] ");
  EXPECT_EQ(shapes(Scheme::kFp8PerTensor, EngineLayout::kVllm, {4, 48, 64}, {24, 24}),
            "weight:f8_e4m3fn[4, 48, 64] weight_scale:f32[4] ");
  EXPECT_EQ(shapes(Scheme::kFp8PerChannel, EngineLayout::kVllm, {96, 64}), "weight:f8_e4m3fn[96, 64] weight_scale:f32[96, 1] ");
  EXPECT_EQ(shapes(Scheme::kFp8PerChannel, EngineLayout::kSglang, {96, 64}),
            "weight:f8_e4m3fn[96, 64] weight_scale:f32[1, 96] ");
  EXPECT_EQ(shapes(Scheme::kFp8Block, EngineLayout::kVllm, {300, 260}),
            "weight:f8_e4m3fn[300, 260] weight_scale_inv:f32[3, 3] ");
  EXPECT_EQ(shapes(Scheme::kFp8Block, EngineLayout::kSglang, {2, 256, 136}, {128, 128}),
            "weight:f8_e4m3fn[2, 256, 136] weight_scale_inv:f32[2, 2, 2] ");
  EXPECT_EQ(shapes(Scheme::kInt8PerChannel, EngineLayout::kVllm, {96, 64}), "weight:i8[96, 64] weight_scale:f32[96, 1] ");
  EXPECT_EQ(shapes(Scheme::kInt8PerChannel, EngineLayout::kSglang, {2, 96, 64}),
            "weight:i8[2, 96, 64] weight_scale:f32[2, 96, 1] ");
  EXPECT_EQ(shapes(Scheme::kNone, EngineLayout::kVllm, {96, 64}), "weight:bf16[96, 64] ");
}

TEST(EngineLayouts, UndefinedCombinationsAreRefusedSayingWhy) {
  auto refused = [](Scheme s, EngineLayout l, Shape shape, std::vector<int64_t> shards, const std::string& why) {
    auto t = storage_layout(s, l, shape, shards);
    ASSERT_FALSE(t.ok()) << scheme_name(s);
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(why), std::string::npos) << t.status().to_string();
    EXPECT_NE(t.status().message().find(engine_layout_name(l)), std::string::npos) << t.status().to_string();
  };
  refused(Scheme::kFp8PerTensor, EngineLayout::kSglang, {96, 64}, {}, "per channel");
  refused(Scheme::kInt4Group, EngineLayout::kVllm, {96, 128}, {}, "Marlin");
  refused(Scheme::kGptqInt4, EngineLayout::kSglang, {96, 128}, {}, "Marlin");
  refused(Scheme::kFp8Block, EngineLayout::kVllm, {2, 200, 128}, {100, 100}, "multiple of 128");
  refused(Scheme::kFp8PerChannel, EngineLayout::kVllm, {2, 96, 64}, {}, "fused experts");
  refused(Scheme::kInt4Group, EngineLayout::kVllm, {2, 256, 128}, {128, 128}, "w13_weight_packed.shape[2]");
  EXPECT_TRUE(storage_layout(Scheme::kInt4Group, EngineLayout::kVllm, {2, 128, 128}, {}, DType::kBF16).ok())
      << "w2 of one group: its size_k is its input's, as ferry permutes it";
  // An engine layout's outputs are checked against its own shapes: ferry's [rows] scale is refused.
  HostTensor in = make_input(DType::kBF16, {8, 64}, 3);
  auto ferry_layout = storage_layout(Scheme::kFp8PerChannel, {8, 64}, {});
  ASSERT_TRUE(ferry_layout.ok());
  Outputs o = make_outputs(*ferry_layout);
  const Status st = quantize(Scheme::kFp8PerChannel, EngineLayout::kVllm, in.view(), {}, o.views);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("vllm layout"), std::string::npos) << st.to_string();
}

// int8_per_channel keeps ferry's arithmetic in the engine layouts (the engines load int8 weights as
// they are): the same bytes as ferry's layout, under the [rows, 1] scale shape.
TEST(EngineLayouts, Int8HasFerrysBytesInTheEnginesShape) {
  for (EngineLayout l : {EngineLayout::kVllm, EngineLayout::kSglang}) {
    HostTensor in = make_input(DType::kBF16, {30, 256}, 5);
    auto layout = storage_layout(Scheme::kInt8PerChannel, l, in.shape, {});
    ASSERT_TRUE(layout.ok());
    Outputs o = make_outputs(*layout);
    ASSERT_TRUE(quantize(Scheme::kInt8PerChannel, l, in.view(), {}, o.views).ok());
    const auto want = ref_quantize_matrix(Scheme::kInt8PerChannel, in, {}, DType::kBF16);
    EXPECT_EQ(o.bytes(), want) << engine_layout_name(l);
  }
}

}  // namespace
}  // namespace ferry::kernels::testing

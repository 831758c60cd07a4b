// kernels::quantize_rows_keeping_scales, fp8_per_tensor's delta path: bit for bit against the
// reference quantizer, writing only what a change reaches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kernels/quantize.h"
#include "tests/kernels/ref_quantize.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

// quantize_rows_keeping_scales, the delta path of fp8_per_tensor: version 2 changes a few rows of a
// parameter quantized at version 1. Storage ends as the reference quantization of version 2; in a
// shard whose scale comes out as stored only the changed rows are written (the others, poisoned
// here, are not touched), and a shard whose amax a changed element moved is written whole.
TEST(KeepScales, PerTensorWritesOnlyChangedRowsWhileTheScalesHold) {
  const Shape shape{300, 130};
  const std::vector<int64_t> shards{150, 100, 50};
  const std::vector<std::pair<int64_t, int64_t>> rows{{10, 11}, {140, 161}, {200, 204}};  // one crosses shards
  // Weights as a trained layer holds them (make_input's rows hold every bf16 pattern, so its amax
  // is the largest finite one already).
  HostTensor v1 = empty_like(DType::kBF16, shape);
  std::mt19937_64 rng(31);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (size_t i = 0; i < v1.bytes.size(); i += 2) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(v1.bytes.data() + i, &h, 2);
    v1.values.push_back(static_cast<float>(testref::decode_bf16(h)));
  }
  for (const bool moves : {false, true}) {
    SCOPED_TRACE(moves ? "an amax moves" : "the scales hold");
    HostTensor v2 = v1;
    auto set = [&](int64_t r, int64_t c, uint16_t bf16) {
      std::memcpy(v2.bytes.data() + (r * 130 + c) * 2, &bf16, 2);
      v2.values[static_cast<size_t>(r * 130 + c)] = static_cast<float>(testref::decode_bf16(bf16));
    };
    for (const auto& [r0, r1] : rows) {
      for (int64_t r = r0; r < r1; ++r) set(r, 3, 0x0000);  // zeros: no amax grows
    }
    if (moves) set(160, 7, 0x4248);  // 50.0: far above every other element, shard 1's scale moves
    auto layout = storage_layout(Scheme::kFp8PerTensor, shape, shards);
    ASSERT_TRUE(layout.ok());
    Outputs out = make_outputs(*layout);
    ASSERT_TRUE(quantize(Scheme::kFp8PerTensor, v1.view(), shards, out.views).ok());
    const auto want1 = ref_quantize(Scheme::kFp8PerTensor, v1, shards, DType::kBF16);
    const auto want2 = ref_quantize(Scheme::kFp8PerTensor, v2, shards, DType::kBF16);
    ASSERT_EQ(out.tensors[0].bytes, want1[0]);
    ASSERT_EQ(want1[1] == want2[1], !moves) << "the reference's scales";
    ASSERT_EQ(std::memcmp(want1[1].data(), want2[1].data(), 4), 0) << "shard 0 holds its scale";
    // Rows outside the change keep their version-1 codes, so poison marks what gets written.
    for (int64_t r = 0; r < shape[0]; ++r) {
      bool changed = false;
      for (const auto& [r0, r1] : rows) changed = changed || (r >= r0 && r < r1);
      if (!changed) std::memset(out.tensors[0].bytes.data() + r * 130, 0xEE, 130);
    }
    auto written =
        quantize_rows_keeping_scales(Scheme::kFp8PerTensor, EngineLayout::kFerry, v2.view(), shards, rows, out.views);
    ASSERT_TRUE(written.ok()) << written.status().to_string();
    // Rows 10, 140-160 and 200-203; with shard 1 (rows 150-249) moved, rows 10 and 140-149 and all
    // of shard 1.
    EXPECT_EQ(*written, moves ? 1 + 10 + 100 : 1 + 21 + 4);
    EXPECT_EQ(out.tensors[1].bytes, want2[1]);
    for (int64_t r = 0; r < shape[0]; ++r) {
      const uint8_t* got = out.tensors[0].bytes.data() + r * 130;
      bool changed = moves && r >= 150 && r < 250;
      for (const auto& [r0, r1] : rows) changed = changed || (r >= r0 && r < r1);
      if (changed) {
        EXPECT_EQ(std::memcmp(got, want2[0].data() + r * 130, 130), 0) << "row " << r;
      } else {
        EXPECT_EQ(std::count(got, got + 130, uint8_t{0xEE}), 130) << "row " << r << " was written";
      }
    }
  }
}

// vLLM's layout keeps one scale for the fused parameter: the same rows give what quantize() of the
// whole version gives in that layout; other schemes and bad rows are declined or refused.
TEST(KeepScales, VllmLayoutAndRefusals) {
  const Shape shape{256, 64};
  HostTensor v1 = make_input(DType::kBF16, shape, 5);
  HostTensor v2 = v1;
  std::memset(v2.bytes.data() + 40 * 64 * 2, 0, 64 * 2);  // row 40 zeroed
  auto layout = storage_layout(Scheme::kFp8PerTensor, EngineLayout::kVllm, shape, {});
  ASSERT_TRUE(layout.ok());
  Outputs out = make_outputs(*layout), whole = make_outputs(*layout);
  ASSERT_TRUE(quantize(Scheme::kFp8PerTensor, EngineLayout::kVllm, v1.view(), {}, out.views).ok());
  ASSERT_TRUE(quantize(Scheme::kFp8PerTensor, EngineLayout::kVllm, v2.view(), {}, whole.views).ok());
  const std::vector<std::pair<int64_t, int64_t>> rows{{40, 41}};
  auto kept = quantize_rows_keeping_scales(Scheme::kFp8PerTensor, EngineLayout::kVllm, v2.view(), {}, rows, out.views);
  ASSERT_TRUE(kept.ok()) << kept.status().to_string();
  EXPECT_EQ(*kept, 1) << "the one changed row, the scale holding";
  EXPECT_EQ(out.bytes(), whole.bytes());

  auto per_channel = storage_layout(Scheme::kFp8PerChannel, shape, {});
  Outputs pc = make_outputs(*per_channel);
  kept = quantize_rows_keeping_scales(Scheme::kFp8PerChannel, EngineLayout::kFerry, v2.view(), {}, rows, pc.views);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, 0) << "only fp8_per_tensor keeps scales";
  const std::vector<std::pair<int64_t, int64_t>> bad{{41, 40}}, past{{250, 257}}, unsorted{{50, 60}, {10, 20}};
  for (const auto& r : {bad, past, unsorted}) {
    kept = quantize_rows_keeping_scales(Scheme::kFp8PerTensor, EngineLayout::kVllm, v2.view(), {}, r, out.views);
    EXPECT_EQ(kept.status().code(), StatusCode::kInvalidArgument) << kept.status().to_string();
  }
}

}  // namespace
}  // namespace ferry::kernels::testing

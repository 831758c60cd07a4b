// Every online scheme on the CPU, bit for bit against the reference quantizer in reference.h, over
// random and adversarial inputs; and CUDA bit for bit against the CPU when a device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/float_convert.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/ref_quantize.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

struct Case {
  Scheme scheme;
  DType in_dtype;
  DType none_dtype;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(scheme_name(info.param.scheme)) + "_" + std::string(dtype_name(info.param.in_dtype)) + "_to_" +
         std::string(dtype_name(info.param.none_dtype));
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType in : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) cases.push_back({Scheme::kNone, in, out});
    for (Scheme s : {Scheme::kFp8PerTensor, Scheme::kFp8PerChannel, Scheme::kFp8Block, Scheme::kInt8PerChannel,
                     Scheme::kInt4Group}) {
      cases.push_back({s, in, DType::kBF16});
    }
  }
  return cases;
}

std::vector<Shape> shapes_for(Scheme s) {
  // Rank 3: stacked matrices (fused experts) for the per-channel, per-group and block schemes;
  // [3, 130, 200] has partial 128-row bands inside every matrix.
  if (s == Scheme::kInt4Group) return {{1, 128}, {3, 256}, {10, 384}, {131, 128}, {4, 2, 128}, {3, 5, 256}, {0, 128}};
  return {{1, 1}, {3, 5}, {10, 130}, {128, 128}, {130, 257}, {257, 200}, {4, 3, 43}, {3, 130, 200}, {2, 2, 3, 5},
          {0, 16}};
}

std::vector<int64_t> shards_for(Scheme s, int64_t rows) {
  if (s != Scheme::kFp8PerTensor || rows < 3) return {};
  // (fp8_per_tensor views every shape as dim 0 x the rest, so shards split dim 0.)
  return {rows / 2, rows / 3, rows - rows / 2 - rows / 3};  // q, k, v of different sizes
}

class QuantizeTest : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizeTest, CpuMatchesReference) {
  const Case c = GetParam();
  uint64_t seed = 1;
  for (const Shape& shape : shapes_for(c.scheme)) {
    for (int rep = 0; rep < 3; ++rep, ++seed) {
      SCOPED_TRACE("shape " + shape_to_string(shape) + " seed " + std::to_string(seed));
      HostTensor in = make_input(c.in_dtype, shape, seed);
      const auto shards = shards_for(c.scheme, in.rows());
      auto layout = storage_layout(c.scheme, shape, shards, c.none_dtype);
      ASSERT_TRUE(layout.ok()) << layout.status().to_string();
      Outputs out = make_outputs(*layout);
      Status st = quantize(c.scheme, in.view(), shards, out.views);
      ASSERT_TRUE(st.ok()) << st.to_string();
      const auto want = ref_quantize(c.scheme, in, shards, c.none_dtype);
      ASSERT_EQ(want.size(), out.tensors.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(same_bytes(out.tensors[i].dtype, out.tensors[i].bytes, want[i])) << "output " << (*layout)[i].suffix;
      }
      // Dequantize back, against the reference dequantization of the same stored bytes.
      HostTensor deq = empty_like(DType::kF32, shape);
      st = dequantize(c.scheme, out.views, shards, deq.view());
      ASSERT_TRUE(st.ok()) << st.to_string();
      const auto want_deq = ref_dequantize(c.scheme, out.bytes(), c.none_dtype, shape, shards);
      // The 2-D view (dim 0 x the rest) of the output names the same weight.
      HostTensor deq2 = empty_like(DType::kF32, {in.rows(), in.cols()});
      st = dequantize(c.scheme, out.views, shards, deq2.view());
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(deq2.bytes, deq.bytes);
      std::vector<uint8_t> want_bytes(want_deq.size() * 4);
      if (!want_deq.empty()) std::memcpy(want_bytes.data(), want_deq.data(), want_bytes.size());
      EXPECT_TRUE(same_f32_nan_sign(deq.bytes, want_bytes)) << "dequantize";
    }
  }
}

// Large enough to split across workers; every thread count gives the same bytes as the reference.
TEST_P(QuantizeTest, CpuThreadsAgree) {
  const Case c = GetParam();
  const Shape shape{1024, 640};
  HostTensor in = make_input(c.in_dtype, shape, 99);
  const auto shards = shards_for(c.scheme, in.rows());
  auto layout = storage_layout(c.scheme, shape, shards, c.none_dtype);
  ASSERT_TRUE(layout.ok());
  const auto want = ref_quantize(c.scheme, in, shards, c.none_dtype);
  for (int threads : {1, 2, 5}) {
    Outputs out = make_outputs(*layout);
    ASSERT_TRUE(quantize(c.scheme, in.view(), shards, out.views, Exec{nullptr, threads}).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(same_bytes(out.tensors[i].dtype, out.tensors[i].bytes, want[i])) << "threads " << threads;
    }
  }
}

TEST_P(QuantizeTest, CudaMatchesCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  uint64_t seed = 500;
  std::vector<Shape> shapes = shapes_for(c.scheme);
  shapes.push_back(c.scheme == Scheme::kInt4Group ? Shape{777, 1024} : Shape{777, 1000});
  for (const Shape& shape : shapes) {
    for (size_t run = 0; run < 3; ++run) {  // make_input, aligned and not; tile_input (finite tiles), aligned
      const size_t misalign = run == 1 ? 4 : 0;
      SCOPED_TRACE("shape " + shape_to_string(shape) + " input offset " + std::to_string(misalign) +
                   (run == 2 ? " finite tiles" : ""));
      HostTensor in = run == 2 ? tile_input(c.in_dtype, shape, seed++) : make_input(c.in_dtype, shape, seed++);
      const auto shards = shards_for(c.scheme, in.rows());
      auto layout = storage_layout(c.scheme, shape, shards, c.none_dtype);
      ASSERT_TRUE(layout.ok());
      Outputs cpu = make_outputs(*layout);
      ASSERT_TRUE(quantize(c.scheme, in.view(), shards, cpu.views).ok());
      DeviceTensor din = to_device(in.bytes, in.dtype, shape, misalign);
      std::vector<DeviceTensor> douts;
      std::vector<TensorView> dviews;
      for (const auto& t : *layout) {
        douts.push_back(device_output(t.dtype, t.shape));
        dviews.push_back(douts.back().view);
      }
      Status st = quantize(c.scheme, din.view, shards, dviews);
      ASSERT_TRUE(st.ok()) << st.to_string();
      for (size_t i = 0; i < dviews.size(); ++i) {
        EXPECT_TRUE(same_bytes(dviews[i].dtype(), to_host(dviews[i]), cpu.tensors[i].bytes)) << (*layout)[i].suffix;
      }
      DeviceTensor ddeq = device_output(DType::kF32, {in.rows(), in.cols()});
      HostTensor deq = empty_like(DType::kF32, {in.rows(), in.cols()});
      ASSERT_TRUE(dequantize(c.scheme, cpu.views, shards, deq.view()).ok());
      st = dequantize(c.scheme, dviews, shards, ddeq.view);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(same_f32_nan_sign(to_host(ddeq.view), deq.bytes)) << "dequantize";
    }
  }
}

// Codes written one byte off alignment (a view into a packed buffer), from aligned input: the
// kernels take their byte-store paths (int4_group's bf16 kernel among them), bit for bit with the
// CPU. Outputs of wider dtypes keep their alignment.
TEST_P(QuantizeTest, CudaUnalignedCodesMatchCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const Shape shape = c.scheme == Scheme::kInt4Group ? Shape{96, 1024} : Shape{96, 1000};
  HostTensor in = make_input(c.in_dtype, shape, 901);
  const auto shards = shards_for(c.scheme, in.rows());
  auto layout = storage_layout(c.scheme, shape, shards, c.none_dtype);
  ASSERT_TRUE(layout.ok());
  Outputs cpu = make_outputs(*layout);
  ASSERT_TRUE(quantize(c.scheme, in.view(), shards, cpu.views).ok());
  DeviceTensor din = to_device(in.bytes, in.dtype, shape, 0);
  std::vector<DeviceTensor> douts;
  std::vector<TensorView> dviews;
  bool any = false;
  for (const auto& t : *layout) {
    const bool bytes = dtype_bytes(t.dtype, 1) == 1;
    any = any || bytes;
    douts.push_back(device_output(t.dtype, t.shape, bytes ? 1 : 0));
    dviews.push_back(douts.back().view);
  }
  if (!any) GTEST_SKIP() << "no one-byte output";
  const Status st = quantize(c.scheme, din.view, shards, dviews);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (size_t i = 0; i < dviews.size(); ++i) {
    EXPECT_TRUE(same_bytes(dviews[i].dtype(), to_host(dviews[i]), cpu.tensors[i].bytes)) << (*layout)[i].suffix;
  }
}

// The CUDA kernels' fast paths (an integer amax of bf16 magnitudes, and x * (1/s) in place of
// x / s away from rounding midpoints) against the CPU, exhaustively: every finite bf16 of
// magnitude up to A, under scales from several A (s = A / 448: powers of two, thirds, a huge and a
// tiny scale where 1/s leaves the safe range), each row led by A, one row with inf and NaN. The
// CPU side of the same inputs is checked against the reference in exhaustive_test.cc.
TEST(FastQuant, EveryBf16UnderSeveralScalesMatchesCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t cols = 8192;
  for (float a : {448.0f, 1.0f, 3.0f, 613.0f, 1e-3f, 7.5e4f, 3e38f, 1e-37f}) {
    const uint16_t ab = f32_to_bf16(a);
    const std::vector<uint16_t> vals = finite_bf16_up_to(ab);
    const int64_t per_row = cols - 1;
    const int64_t rows = static_cast<int64_t>((vals.size() + per_row - 1) / per_row) + 1;
    std::vector<uint16_t> data(static_cast<size_t>(rows * cols), 0);
    for (int64_t r = 0; r < rows; ++r) data[static_cast<size_t>(r * cols)] = ab;
    for (size_t i = 0; i < vals.size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) / per_row, c = 1 + static_cast<int64_t>(i) % per_row;
      data[static_cast<size_t>(r * cols + c)] = vals[i];
    }
    // The last row: inf, -inf and NaN beside ordinary values (left out of amax, NaN codes 0x7F).
    const int64_t last = (rows - 1) * cols;
    data[static_cast<size_t>(last + 1)] = 0x7F80;
    data[static_cast<size_t>(last + 2)] = 0xFF80;
    data[static_cast<size_t>(last + 3)] = 0x7FC1;
    data[static_cast<size_t>(last + 4)] = f32_to_bf16(a / 3.0f);
    std::vector<uint8_t> bytes(data.size() * 2);
    std::memcpy(bytes.data(), data.data(), bytes.size());
    const Shape shape{rows, cols};
    for (Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kFp8PerTensor, Scheme::kFp8Block, Scheme::kInt8PerChannel,
                          Scheme::kInt4Group}) {
      SCOPED_TRACE(std::string(scheme_name(scheme)) + " A=" + std::to_string(a));
      HostTensor in{DType::kBF16, shape, bytes, {}};
      auto layout = storage_layout(scheme, shape, {}, DType::kBF16);
      ASSERT_TRUE(layout.ok());
      Outputs cpu = make_outputs(*layout);
      ASSERT_TRUE(quantize(scheme, in.view(), {}, cpu.views).ok());
      DeviceTensor din = to_device(bytes, DType::kBF16, shape, 0);
      std::vector<DeviceTensor> douts;
      std::vector<TensorView> dviews;
      for (const auto& t : *layout) {
        douts.push_back(device_output(t.dtype, t.shape));
        dviews.push_back(douts.back().view);
      }
      ASSERT_TRUE(quantize(scheme, din.view, {}, dviews).ok());
      for (size_t i = 0; i < dviews.size(); ++i) {
        EXPECT_TRUE(same_bytes(dviews[i].dtype(), to_host(dviews[i]), cpu.tensors[i].bytes)) << (*layout)[i].suffix;
      }
    }
  }
}

// Fused expert weights [E, rows, cols]: one set of scales per matrix, E in front.
// fp8_per_tensor of `in` on the GPU against the CPU kernels, bit for bit; returns how many
// one-piece kernels (quantize_tensor.cu) the call launched.
uint64_t expect_per_tensor_matches_cpu(HostTensor in, const std::vector<int64_t>& shards) {
  auto layout = storage_layout(Scheme::kFp8PerTensor, in.shape, shards, in.dtype);
  EXPECT_TRUE(layout.ok()) << layout.status().to_string();
  if (!layout.ok()) return 0;
  Outputs cpu = make_outputs(*layout);
  EXPECT_TRUE(quantize(Scheme::kFp8PerTensor, in.view(), shards, cpu.views).ok());
  DeviceTensor din = to_device(in.bytes, in.dtype, in.shape, 0);
  std::vector<DeviceTensor> douts;
  std::vector<TensorView> dviews;
  for (const auto& t : *layout) {
    douts.push_back(device_output(t.dtype, t.shape));
    dviews.push_back(douts.back().view);
  }
  const uint64_t before = detail::cuda::fused_per_tensor_launches();
  const Status st = quantize(Scheme::kFp8PerTensor, din.view, shards, dviews);
  EXPECT_TRUE(st.ok()) << st.to_string();
  for (size_t i = 0; i < dviews.size(); ++i) {
    EXPECT_TRUE(same_bytes(dviews[i].dtype(), to_host(dviews[i]), cpu.tensors[i].bytes)) << (*layout)[i].suffix;
  }
  return detail::cuda::fused_per_tensor_launches() - before;
}

int device_sms() {
  int sms = 0;
#if defined(FERRY_HAVE_CUDA)
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) return 0;
#endif
  return sms;
}

// Rows of `cols` elements of `elem` bytes that make a shard the one-piece kernel takes (and at least
// `floor`): shards smaller than the device's L2 take the two kernels.
int64_t one_piece_rows(int64_t cols, int64_t elem, int64_t floor) {
  const int64_t min = detail::cuda::fused_per_tensor_min_bytes();
  return std::max(floor, (min + cols * elem - 1) / (cols * elem));
}

// fp8_per_tensor on shards larger than L2: one kernel per shard on Hopper, each block's last chunks
// kept on chip and the encode reading part of the rest from L2, with three shards of different
// sizes; then with one shard below the device's limit, where every shard takes the two kernels.
TEST(FastQuant, PerTensorLargerThanL2MatchesCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t r = one_piece_rows(8192, 2, 1024);
  const bool one_piece = detail::cuda::fused_per_tensor_min_bytes() > 0;
  uint64_t launched = expect_per_tensor_matches_cpu(make_input(DType::kBF16, {4 * r + 512, 8192}, 77),
                                                   {2 * r, r, r + 512});
  if (one_piece) {
    EXPECT_EQ(launched, 3u) << "one kernel per shard of at least " << detail::cuda::fused_per_tensor_min_bytes()
                            << " bytes";
  }
  // 8 MiB: above the 4 MiB floor of the limit, below the L2 of the devices that have the kernel.
  launched = expect_per_tensor_matches_cpu(make_input(DType::kBF16, {2 * r + 512, 8192}, 78), {2 * r, 512});
  if (detail::cuda::fused_per_tensor_min_bytes() > (int64_t{8} << 20)) {
    EXPECT_EQ(launched, 0u) << "a shard smaller than L2 sends the call to the two kernels";
  }
}

// The same for f16 and f32 inputs (their own amax bits and vector widths), two shards each.
TEST(FastQuant, PerTensorOnePieceF16AndF32MatchCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  for (DType d : {DType::kF16, DType::kF32}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    const int64_t r = one_piece_rows(2048, dtype_bytes(d, 1), 1024);
    const uint64_t launched = expect_per_tensor_matches_cpu(make_input(d, {3 * r, 2048}, 5), {2 * r, r});
    if (detail::cuda::fused_per_tensor_min_bytes() > 0) {
      EXPECT_EQ(launched, 2u);
    }
  }
}

// How the one-piece kernel deals a shard out to its blocks: whole rounds of 32 KiB chunks, then the
// remainder split on 1 KiB into one shorter chunk per block. Remainders of one vector, of just under
// a whole round (the last block's piece is then largest: split points rounded down gave it 63
// vectors more than its 32 KiB slot holds, left unencoded), and in between.
TEST(FastQuant, PerTensorOnePieceRemaindersMatchCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t min = detail::cuda::fused_per_tensor_min_bytes();
  if (min == 0) GTEST_SKIP() << "no one-piece kernel on this device (it needs sm_90)";
  const int sms = device_sms();
  ASSERT_GT(sms, 0);
  const int64_t round = int64_t{sms} * 2048;  // 16-byte vectors in one chunk per block
  const int64_t k = (min + round * 16 - 1) / (round * 16);  // whole rounds that reach the limit
  for (int64_t nv : {(k + 1) * round - 1, k * round + 1, (k + 2) * round + int64_t{sms} * 64 * 5 + 17}) {
    SCOPED_TRACE("vectors " + std::to_string(nv));
    EXPECT_EQ(expect_per_tensor_matches_cpu(make_input(DType::kBF16, {nv, 8}, 31), {}), 1u);
  }
}

// The one-piece kernel's division (x * y corrected with one fma, no per-element range test) and
// its fallbacks, exhaustively: every finite bf16 of magnitude up to A (-0 and subnormals included),
// spread over a tensor the one-piece kernel takes, under scales from several A (s = A / 448; 3e38 and 1e-37 put s
// outside [2^-60, 2^60], where every element takes the exact division); then with one -inf and
// one NaN, which must be left out of the amax (taken again in floats) and send every element to
// the exact division.
TEST(FastQuant, PerTensorOnePieceEveryBf16MatchesCpu) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t cols = 8192, rows = one_piece_rows(cols, 2, 1024);
  for (float a : {448.0f, 1.0f, 3.0f, 613.0f, 1e-3f, 7.5e4f, 3e38f, 1e-37f}) {
    const uint16_t ab = f32_to_bf16(a);
    const std::vector<uint16_t> vals = finite_bf16_up_to(ab);
    std::vector<uint16_t> data(static_cast<size_t>(rows * cols));
    for (size_t i = 0; i < data.size(); ++i) data[i] = vals[(i * 7919) % vals.size()];
    data[12345] = ab;
    for (bool nonfinite : {false, true}) {
      SCOPED_TRACE("A=" + std::to_string(a) + (nonfinite ? " with inf and NaN" : ""));
      if (nonfinite) {
        data[777] = 0xFF80;
        data[data.size() - 3] = 0x7FC1;
      }
      HostTensor in{DType::kBF16, Shape{rows, cols}, std::vector<uint8_t>(data.size() * 2), {}};
      std::memcpy(in.bytes.data(), data.data(), in.bytes.size());
      const uint64_t launched = expect_per_tensor_matches_cpu(std::move(in), {});
      if (detail::cuda::fused_per_tensor_min_bytes() > 0) {
        EXPECT_EQ(launched, 1u);
      }
    }
  }
}

TEST(StackedLayout, ScalesCarryTheExpertDim) {
  auto shape_of = [](Scheme s, const Shape& shape, size_t i) {
    auto l = storage_layout(s, shape, {});
    EXPECT_TRUE(l.ok()) << l.status().to_string();
    return l.ok() ? (*l)[i].shape : Shape{};
  };
  EXPECT_EQ(shape_of(Scheme::kFp8PerChannel, {8, 3, 256}, 1), (Shape{8, 3}));
  EXPECT_EQ(shape_of(Scheme::kInt8PerChannel, {8, 3, 256}, 1), (Shape{8, 3}));
  EXPECT_EQ(shape_of(Scheme::kInt4Group, {8, 3, 256}, 0), (Shape{8, 3, 256}));
  EXPECT_EQ(shape_of(Scheme::kInt4Group, {8, 3, 256}, 1), (Shape{8, 3, 2}));
  EXPECT_EQ(shape_of(Scheme::kFp8Block, {8, 130, 200}, 1), (Shape{8, 2, 2}));
  EXPECT_EQ(shape_of(Scheme::kFp8Block, {8, 130, 2, 100}, 1), (Shape{8, 2, 2}));
  EXPECT_EQ(shape_of(Scheme::kFp8PerTensor, {8, 3, 256}, 1), (Shape{1}));
  EXPECT_EQ(shape_of(Scheme::kFp8PerChannel, {8, 256}, 1), (Shape{8}));
  // int4 groups run along the last dims of one matrix.
  EXPECT_FALSE(storage_layout(Scheme::kInt4Group, {2, 128, 64}, {}).ok());
}

// A stacked weight gives, matrix by matrix, the bytes of quantizing each matrix alone.
TEST(StackedLayout, EachMatrixAsAlone) {
  for (Scheme s : {Scheme::kFp8PerChannel, Scheme::kInt8PerChannel, Scheme::kInt4Group, Scheme::kFp8Block}) {
    SCOPED_TRACE(std::string(scheme_name(s)));
    const Shape shape{3, 131, 256};
    HostTensor in = make_input(DType::kBF16, shape, 7);
    auto layout = storage_layout(s, shape, {});
    ASSERT_TRUE(layout.ok());
    Outputs all = make_outputs(*layout);
    ASSERT_TRUE(quantize(s, in.view(), {}, all.views, Exec{nullptr, 2}).ok());
    for (int64_t e = 0; e < shape[0]; ++e) {
      HostTensor m = matrix_of(in, e);
      auto ml = storage_layout(s, m.shape, {});
      ASSERT_TRUE(ml.ok());
      Outputs one = make_outputs(*ml);
      ASSERT_TRUE(quantize(s, m.view(), {}, one.views).ok());
      for (size_t t = 0; t < one.tensors.size(); ++t) {
        const size_t n = one.tensors[t].bytes.size();
        const std::vector<uint8_t> part(all.tensors[t].bytes.begin() + static_cast<std::ptrdiff_t>(e * n),
                                        all.tensors[t].bytes.begin() + static_cast<std::ptrdiff_t>((e + 1) * n));
        EXPECT_EQ(part, one.tensors[t].bytes) << "matrix " << e << " tensor " << (*ml)[t].suffix;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSchemes, QuantizeTest, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace ferry::kernels::testing

// Every bf16 value through the CPU kernels, bit for bit against the independent reference
// (ref_quantize.h), under several scales; every bf16 and f16 code through scheme none; and scheme
// none's NaN rule spelled out code by code, on the CPU and, with a device, on CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/quantize.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/ref_quantize.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

constexpr int64_t kCols = 8192;  // a multiple of 128: int4_group's groups and fp8_block's blocks

// A [rows, kCols] bf16 or f16 tensor holding `codes` row by row (the rest zeros), with the exact
// value of each code decoded by the reference.
HostTensor from_codes(DType dtype, const std::vector<uint16_t>& codes) {
  const int64_t rows = (static_cast<int64_t>(codes.size()) + kCols - 1) / kCols;
  HostTensor t;
  t.dtype = dtype;
  t.shape = {rows, kCols};
  std::vector<uint16_t> all(static_cast<size_t>(rows * kCols), 0);
  std::copy(codes.begin(), codes.end(), all.begin());
  t.bytes.resize(all.size() * 2);
  std::memcpy(t.bytes.data(), all.data(), t.bytes.size());
  for (uint16_t c : all) {
    t.values.push_back(to_float(dtype == DType::kBF16 ? testref::decode_bf16(c) : testref::decode_f16(c)));
  }
  return t;
}

// Every finite bf16 of magnitude up to |A|, each row led by A or -A (the row's amax, so s = A / 448,
// A / 127 or A / 7 per row), and a last row of every inf and NaN code among finite values: they
// are left out of amax, NaN becomes 0x7F (fp8) or 0, +-inf saturate.
HostTensor every_bf16_under(float a) {
  const uint16_t ab = testref::encode_bf16(a);
  const std::vector<uint16_t> vals = finite_bf16_up_to(ab);
  std::vector<uint16_t> codes;
  size_t next = 0;
  for (int64_t r = 0; next < vals.size(); ++r) {
    codes.push_back(static_cast<uint16_t>(r % 2 ? ab | 0x8000 : ab));
    for (int64_t c = 1; c < kCols && next < vals.size(); ++c) codes.push_back(vals[next++]);
  }
  codes.resize((codes.size() + kCols - 1) / kCols * kCols, 0);
  codes.push_back(ab);
  for (uint32_t m = 0; m < 0x80; ++m) {
    codes.push_back(static_cast<uint16_t>(0x7F80 | m));  // +inf, then the positive NaNs
    codes.push_back(static_cast<uint16_t>(0xFF80 | m));  // -inf, then the negative NaNs
    codes.push_back(testref::encode_bf16(a / 3.0f * static_cast<float>(m % 5)));
  }
  return from_codes(DType::kBF16, codes);
}

// Quantizes `in` on the CPU (workers split the rows) and compares every output tensor with the
// reference, then the dequantized values with the reference dequantization of the same bytes.
void expect_cpu_matches_reference(Scheme scheme, const HostTensor& in_const, DType none_dtype) {
  HostTensor in = in_const;
  auto layout = storage_layout(scheme, in.shape, {}, none_dtype);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  Outputs out = make_outputs(*layout);
  Status st = quantize(scheme, in.view(), {}, out.views, Exec{nullptr, 2});
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto want = ref_quantize(scheme, in, {}, none_dtype);
  ASSERT_EQ(want.size(), out.tensors.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(same_bytes(out.tensors[i].dtype, out.tensors[i].bytes, want[i])) << (*layout)[i].suffix;
  }
  HostTensor deq = empty_like(DType::kF32, in.shape);
  st = dequantize(scheme, out.views, {}, deq.view());
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto want_deq = ref_dequantize(scheme, out.bytes(), none_dtype, in.shape, {});
  std::vector<uint8_t> want_bytes(want_deq.size() * 4);
  std::memcpy(want_bytes.data(), want_deq.data(), want_bytes.size());
  EXPECT_TRUE(same_f32_nan_sign(deq.bytes, want_bytes)) << "dequantize";
}

TEST(EveryBf16, CpuMatchesReferenceUnderSeveralScales) {
  for (float a : {448.0f, 1.0f, 3.0f, 613.0f, 1e-3f, 7.5e4f, 3e38f, 1e-37f}) {
    const HostTensor in = every_bf16_under(a);
    for (Scheme scheme : {Scheme::kFp8PerTensor, Scheme::kFp8PerChannel, Scheme::kFp8Block, Scheme::kInt8PerChannel,
                          Scheme::kInt4Group}) {
      SCOPED_TRACE(std::string(scheme_name(scheme)) + " A=" + std::to_string(a));
      expect_cpu_matches_reference(scheme, in, DType::kBF16);
    }
  }
}

// Every code of bf16 and of f16, -0, subnormals, +-inf and every NaN payload of both signs among
// them, converted to each storage dtype: a conversion rounds to nearest even and makes every NaN
// the storage dtype's quiet NaN with its sign; the same dtype is copied, payloads and all.
TEST(EveryBf16, NoneMatchesReference) {
  std::vector<uint16_t> codes(0x10000);
  for (uint32_t c = 0; c < 0x10000; ++c) codes[c] = static_cast<uint16_t>(c);
  for (DType in_dtype : {DType::kBF16, DType::kF16}) {
    const HostTensor in = from_codes(in_dtype, codes);
    for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(std::string(dtype_name(in_dtype)) + " to " + std::string(dtype_name(out)));
      expect_cpu_matches_reference(Scheme::kNone, in, out);
    }
  }
}

// Scheme none's NaN rule (kernels/quantize.h), written out: input code -> stored code per
// storage dtype. Quiet and signalling NaNs, with payloads, of both signs.
struct NanCase {
  DType in;
  uint32_t code;
  uint32_t to_f32, to_bf16, to_f16;
};

const NanCase kNanCases[] = {
    {DType::kF32, 0x7FC00000u, 0x7FC00000u, 0x7FC0u, 0x7E00u},
    {DType::kF32, 0xFFC00000u, 0xFFC00000u, 0xFFC0u, 0xFE00u},
    {DType::kF32, 0x7F800001u, 0x7F800001u, 0x7FC0u, 0x7E00u},  // signalling, payload 1
    {DType::kF32, 0xFF812345u, 0xFF812345u, 0xFFC0u, 0xFE00u},
    {DType::kF32, 0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FC0u, 0x7E00u},  // payload in bf16's and f16's bits too
    {DType::kBF16, 0x7FC0u, 0x7FC00000u, 0x7FC0u, 0x7E00u},
    {DType::kBF16, 0x7F81u, 0x7FC00000u, 0x7F81u, 0x7E00u},  // signalling
    {DType::kBF16, 0xFFC1u, 0xFFC00000u, 0xFFC1u, 0xFE00u},
    {DType::kBF16, 0xFFFFu, 0xFFC00000u, 0xFFFFu, 0xFE00u},
    {DType::kF16, 0x7E00u, 0x7FC00000u, 0x7FC0u, 0x7E00u},
    {DType::kF16, 0x7C01u, 0x7FC00000u, 0x7FC0u, 0x7C01u},  // signalling
    {DType::kF16, 0xFE01u, 0xFFC00000u, 0xFFC0u, 0xFE01u},
    {DType::kF16, 0xFFFFu, 0xFFC00000u, 0xFFC0u, 0xFFFFu},
};

// One input tensor of dtype `in` holding each NaN case of that dtype (n of them) between ordinary
// values, so that vectorized paths see it: element 16 * k + 5 is case k.
std::vector<uint8_t> nan_input(DType in, std::vector<const NanCase*>& cases) {
  for (const auto& c : kNanCases) {
    if (c.in == in) cases.push_back(&c);
  }
  const size_t es = dtype_bytes(in, 1), n = cases.size() * 16 + 3;
  std::vector<uint8_t> bytes(n * es);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t one = in == DType::kF32 ? 0x3F800000u : in == DType::kBF16 ? 0x3F80u : 0x3C00u;
    std::memcpy(&bytes[i * es], &one, es);
  }
  for (size_t k = 0; k < cases.size(); ++k) std::memcpy(&bytes[(16 * k + 5) * es], &cases[k]->code, es);
  return bytes;
}

void expect_nan_rule(const TensorView& out, const std::vector<uint8_t>& got, const std::vector<const NanCase*>& cases) {
  const size_t es = dtype_bytes(out.dtype(), 1);
  for (size_t k = 0; k < cases.size(); ++k) {
    const NanCase& c = *cases[k];
    const uint32_t want = out.dtype() == DType::kF32 ? c.to_f32 : out.dtype() == DType::kBF16 ? c.to_bf16 : c.to_f16;
    uint32_t code = 0;
    std::memcpy(&code, &got[(16 * k + 5) * es], es);
    EXPECT_EQ(code, want) << dtype_name(c.in) << " NaN "
                          << bits_hex(reinterpret_cast<const uint8_t*>(&c.code), dtype_bytes(c.in, 1)) << " to "
                          << dtype_name(out.dtype());
  }
}

TEST(NoneNan, CpuKeepsSignAndQuietsOnConversion) {
  for (DType in : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<const NanCase*> cases;
    HostTensor input{in, {}, nan_input(in, cases), {}};
    input.shape = {1, static_cast<int64_t>(input.bytes.size() / dtype_bytes(in, 1))};
    for (DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      HostTensor out = empty_like(out_dtype, input.shape);
      const TensorView views[] = {out.view()};
      ASSERT_TRUE(quantize(Scheme::kNone, input.view(), {}, views).ok());
      expect_nan_rule(views[0], out.bytes, cases);
    }
  }
}

TEST(NoneNan, CudaKeepsSignAndQuietsOnConversion) {
  FERRY_SKIP_WITHOUT_GPU();
  for (DType in : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<const NanCase*> cases;
    const std::vector<uint8_t> bytes = nan_input(in, cases);
    const Shape shape{1, static_cast<int64_t>(bytes.size() / dtype_bytes(in, 1))};
    for (size_t misalign : {size_t{0}, size_t{4}}) {
      DeviceTensor din = to_device(bytes, in, shape, misalign);
      for (DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
        DeviceTensor dout = device_output(out_dtype, shape);
        const TensorView views[] = {dout.view};
        const Status st = quantize(Scheme::kNone, din.view, {}, views);
        ASSERT_TRUE(st.ok()) << st.to_string();
        expect_nan_rule(views[0], to_host(views[0]), cases);
      }
    }
  }
}

}  // namespace
}  // namespace ferry::kernels::testing

// The reference quantizer: expected bytes of every storage tensor of a scheme, from reference.h.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/quantize.h"
#include "tests/kernels/reference.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {

template <typename T>
void put(std::vector<uint8_t>& out, size_t i, T v) {
  std::memcpy(&out[i * sizeof(T)], &v, sizeof(T));
}

// `in` must carry exact values; `none_dtype` is the storage dtype of scheme none. One matrix: dim 0
// rows, the rest columns.
inline std::vector<std::vector<uint8_t>> ref_quantize_matrix(Scheme scheme, const HostTensor& in,
                                                      const std::vector<int64_t>& shard_rows, DType none_dtype) {
  const int64_t rows = in.rows(), cols = in.cols();
  const float* x = in.values.data();
  std::vector<uint8_t> w, s;
  auto fp8_rows = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) w[static_cast<size_t>(r * cols + c)] = testref::encode_e4m3(testref::f32_div(x[r * cols + c], scale));
    }
  };
  auto amax_box = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    float m = 0;
    for (int64_t r = r0; r < r1; ++r) m = std::max(m, testref::amax_finite(x + r * cols + c0, c1 - c0));
    return m;
  };
  switch (scheme) {
    case Scheme::kNone:
      // The same dtype is a plain copy (NaN payloads kept); a conversion makes every NaN the quiet
      // NaN of the storage dtype with the input's sign (encode_bf16 / encode_f16, and here for f32).
      if (none_dtype == in.dtype) return {in.bytes};
      w.resize(dtype_bytes(none_dtype, rows * cols));
      for (int64_t i = 0; i < rows * cols; ++i) {
        const float v = x[i];
        const size_t at = static_cast<size_t>(i);
        if (none_dtype == DType::kBF16) {
          put<uint16_t>(w, at, testref::encode_bf16(v));
        } else if (none_dtype == DType::kF16) {
          put<uint16_t>(w, at, testref::encode_f16(v));
        } else if (std::isnan(v)) {
          put<uint32_t>(w, at, std::signbit(v) ? 0xFFC00000u : 0x7FC00000u);
        } else {
          put<float>(w, at, v);
        }
      }
      return {w};
    case Scheme::kFp8PerTensor: {
      std::vector<int64_t> bounds{0};
      if (shard_rows.empty()) bounds.push_back(rows);
      for (int64_t r : shard_rows) bounds.push_back(bounds.back() + r);
      w.resize(static_cast<size_t>(rows * cols));
      s.resize((bounds.size() - 1) * 4);
      for (size_t k = 0; k + 1 < bounds.size(); ++k) {
        const float scale = testref::fp8_scale(amax_box(bounds[k], bounds[k + 1], 0, cols));
        put<float>(s, k, scale);
        fp8_rows(bounds[k], bounds[k + 1], 0, cols, scale);
      }
      return {w, s};
    }
    case Scheme::kFp8PerChannel:
      w.resize(static_cast<size_t>(rows * cols));
      s.resize(static_cast<size_t>(rows) * 4);
      for (int64_t r = 0; r < rows; ++r) {
        const float scale = testref::fp8_scale(amax_box(r, r + 1, 0, cols));
        put<float>(s, static_cast<size_t>(r), scale);
        fp8_rows(r, r + 1, 0, cols, scale);
      }
      return {w, s};
    case Scheme::kFp8Block: {
      const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
      w.resize(static_cast<size_t>(rows * cols));
      s.resize(static_cast<size_t>(br * bc) * 4);
      for (int64_t i = 0; i < br; ++i) {
        for (int64_t j = 0; j < bc; ++j) {
          const int64_t r0 = i * 128, r1 = std::min(rows, r0 + 128), c0 = j * 128, c1 = std::min(cols, c0 + 128);
          const float scale = testref::fp8_scale(amax_box(r0, r1, c0, c1));
          put<float>(s, static_cast<size_t>(i * bc + j), scale);
          fp8_rows(r0, r1, c0, c1, scale);
        }
      }
      return {w, s};
    }
    case Scheme::kInt8PerChannel:
      w.resize(static_cast<size_t>(rows * cols));
      s.resize(static_cast<size_t>(rows) * 4);
      for (int64_t r = 0; r < rows; ++r) {
        const float scale = testref::int8_scale(amax_box(r, r + 1, 0, cols));
        put<float>(s, static_cast<size_t>(r), scale);
        for (int64_t c = 0; c < cols; ++c) {
          w[static_cast<size_t>(r * cols + c)] =
              static_cast<uint8_t>(static_cast<int8_t>(testref::ref_quant_int(x[r * cols + c], scale, -127, 127)));
        }
      }
      return {w, s};
    case Scheme::kInt4Group: {
      const int64_t groups = cols / 128;
      w.assign(static_cast<size_t>(rows * cols / 2), 0);
      s.resize(static_cast<size_t>(rows * groups) * 2);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const uint16_t h = testref::int4_scale(amax_box(r, r + 1, g * 128, g * 128 + 128));
          put<uint16_t>(s, static_cast<size_t>(r * groups + g), h);
          const float scale = static_cast<float>(testref::decode_f16(h));
          for (int64_t c = g * 128; c < g * 128 + 128; ++c) {
            const int q = testref::ref_quant_int(x[r * cols + c], scale, -8, 7);
            const int64_t i = r * cols + c;
            w[static_cast<size_t>(i / 2)] |= static_cast<uint8_t>((q & 0xF) << ((i % 2) * 4));
          }
        }
      }
      return {w, s};
    }
    case Scheme::kGptqInt4: break;
  }
  return {};
}

// Reference dequantization of the bytes `st` (in storage_layout order) to f32 values.
inline std::vector<float> ref_dequantize_matrix(Scheme scheme, const std::vector<std::vector<uint8_t>>& st, DType none_dtype,
                                         int64_t rows, int64_t cols, const std::vector<int64_t>& shard_rows) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  auto f32_at = [&](size_t t, int64_t i) {
    float v;
    std::memcpy(&v, &st[t][static_cast<size_t>(i) * 4], 4);
    return v;
  };
  auto u16_at = [&](size_t t, int64_t i) {
    uint16_t v;
    std::memcpy(&v, &st[t][static_cast<size_t>(i) * 2], 2);
    return v;
  };
  std::vector<int64_t> shard_of(static_cast<size_t>(rows), 0);
  {
    int64_t r = 0, k = 0;
    for (int64_t n : shard_rows) {
      for (int64_t j = 0; j < n; ++j) shard_of[static_cast<size_t>(r++)] = k;
      ++k;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      float v = 0;
      switch (scheme) {
        case Scheme::kNone:
          v = none_dtype == DType::kF32    ? f32_at(0, i)
              : none_dtype == DType::kBF16 ? static_cast<float>(testref::decode_bf16(u16_at(0, i)))
                                           : static_cast<float>(testref::decode_f16(u16_at(0, i)));
          break;
        case Scheme::kFp8PerTensor:
          v = testref::f32_mul(static_cast<float>(testref::decode_e4m3(st[0][static_cast<size_t>(i)])),
                               f32_at(1, shard_of[static_cast<size_t>(r)]));
          break;
        case Scheme::kFp8PerChannel:
          v = testref::f32_mul(static_cast<float>(testref::decode_e4m3(st[0][static_cast<size_t>(i)])), f32_at(1, r));
          break;
        case Scheme::kFp8Block:
          v = testref::f32_mul(static_cast<float>(testref::decode_e4m3(st[0][static_cast<size_t>(i)])),
                               f32_at(1, (r / 128) * ((cols + 127) / 128) + c / 128));
          break;
        case Scheme::kInt8PerChannel:
          v = testref::f32_mul(static_cast<float>(static_cast<int8_t>(st[0][static_cast<size_t>(i)])), f32_at(1, r));
          break;
        case Scheme::kInt4Group: {
          int q = (st[0][static_cast<size_t>(i / 2)] >> ((i % 2) * 4)) & 0xF;
          if (q >= 8) q -= 16;
          v = testref::f32_mul(static_cast<float>(q),
                               static_cast<float>(testref::decode_f16(u16_at(1, r * (cols / 128) + c / 128))));
          break;
        }
        case Scheme::kGptqInt4: break;
      }
      out[static_cast<size_t>(i)] = v;
    }
  }
  return out;
}

// Schemes that quantize a rank >= 3 weight [E, rows, cols...] as E separate matrices.
inline bool stacks(Scheme s, const Shape& shape) {
  return shape.size() >= 3 && (s == Scheme::kFp8PerChannel || s == Scheme::kInt8PerChannel || s == Scheme::kInt4Group ||
                               s == Scheme::kFp8Block);
}

// Matrix e of a stacked input, as a 2-D host tensor.
inline HostTensor matrix_of(const HostTensor& in, int64_t e) {
  HostTensor m;
  m.dtype = in.dtype;
  int64_t cols = 1;
  for (size_t i = 2; i < in.shape.size(); ++i) cols *= in.shape[i];
  m.shape = {in.shape[1], cols};
  const size_t n = static_cast<size_t>(in.shape[1] * cols), es = dtype_bytes(in.dtype, 1);
  m.bytes.assign(in.bytes.begin() + static_cast<std::ptrdiff_t>(e * n * es),
                 in.bytes.begin() + static_cast<std::ptrdiff_t>((e + 1) * n * es));
  m.values.assign(in.values.begin() + static_cast<std::ptrdiff_t>(e * n),
                  in.values.begin() + static_cast<std::ptrdiff_t>((e + 1) * n));
  return m;
}

// Every storage tensor of the scheme for `in`: stacked weights are the matrices' outputs, each
// tensor concatenated over the matrices in order.
inline std::vector<std::vector<uint8_t>> ref_quantize(Scheme scheme, const HostTensor& in,
                                                      const std::vector<int64_t>& shard_rows, DType none_dtype) {
  if (!stacks(scheme, in.shape)) return ref_quantize_matrix(scheme, in, shard_rows, none_dtype);
  std::vector<std::vector<uint8_t>> out;
  for (int64_t e = 0; e < in.shape[0]; ++e) {
    auto part = ref_quantize_matrix(scheme, matrix_of(in, e), shard_rows, none_dtype);
    out.resize(part.size());
    for (size_t t = 0; t < part.size(); ++t) out[t].insert(out[t].end(), part[t].begin(), part[t].end());
  }
  return out;
}

// Reference dequantization of a weight of logical `shape`, matrix by matrix when it stacks.
inline std::vector<float> ref_dequantize(Scheme scheme, const std::vector<std::vector<uint8_t>>& st, DType none_dtype,
                                         const Shape& shape, const std::vector<int64_t>& shard_rows) {
  int64_t rows = shape.empty() ? 1 : shape[0], cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  if (!stacks(scheme, shape)) return ref_dequantize_matrix(scheme, st, none_dtype, rows, cols, shard_rows);
  const int64_t batch = shape[0];
  rows = shape[1];
  cols /= rows > 0 ? rows : 1;
  std::vector<float> out;
  for (int64_t e = 0; e < batch; ++e) {
    std::vector<std::vector<uint8_t>> part;
    for (const auto& t : st) {
      const size_t n = t.size() / static_cast<size_t>(batch);
      part.emplace_back(t.begin() + static_cast<std::ptrdiff_t>(e * n), t.begin() + static_cast<std::ptrdiff_t>((e + 1) * n));
    }
    auto v = ref_dequantize_matrix(scheme, part, none_dtype, rows, cols, shard_rows);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace ferry::kernels::testing

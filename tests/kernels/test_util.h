// Inputs, reference outputs and device copies for the kernels tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "kernels/quantize.h"
#include "tests/kernels/reference.h"

namespace ferry::kernels::testing {

// Host bytes with a shape and dtype; `values` is the exact f32 value of each element of a float
// input.
struct HostTensor {
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  TensorView view() { return TensorView(bytes.data(), dtype, shape); }
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t cols() const {
    int64_t c = 1;
    for (size_t i = 1; i < shape.size(); ++i) c *= shape[i];
    return c;
  }
};

inline HostTensor empty_like(DType dtype, const Shape& shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.bytes.assign(dtype_bytes(dtype, shape_numel(shape)), 0xA5);  // garbage: kernels must overwrite
  return t;
}

// Host outputs of a storage layout, each starting as garbage (empty_like), with views on them.
struct Outputs {
  std::vector<HostTensor> tensors;
  std::vector<TensorView> views;
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& t : tensors) out.push_back(t.bytes);
    return out;
  }
};

inline Outputs make_outputs(const std::vector<StorageTensor>& layout) {
  Outputs o;
  for (const auto& t : layout) o.tensors.push_back(empty_like(t.dtype, t.shape));
  for (auto& t : o.tensors) o.views.push_back(t.view());
  return o;
}

// Every finite bf16 (both zeros and the subnormals included) of magnitude up to that of `ab`.
inline std::vector<uint16_t> finite_bf16_up_to(uint16_t ab) {
  const double limit = std::fabs(testref::decode_bf16(ab));
  std::vector<uint16_t> vals;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const double v = testref::decode_bf16(static_cast<uint16_t>(b));
    if (std::isfinite(v) && std::fabs(v) <= limit) vals.push_back(static_cast<uint16_t>(b));
  }
  return vals;
}

inline float to_float(double v) { return static_cast<float>(v); }

// Encodes an f32 value into `dtype` with the reference encoder and returns the exact value stored.
inline float store_value(HostTensor& t, int64_t i, float v) {
  if (t.dtype == DType::kF32) {
    std::memcpy(&t.bytes[static_cast<size_t>(i) * 4], &v, 4);
    return v;
  }
  const uint16_t code = t.dtype == DType::kBF16 ? testref::encode_bf16(v) : testref::encode_f16(v);
  std::memcpy(&t.bytes[static_cast<size_t>(i) * 2], &code, 2);
  return to_float(t.dtype == DType::kBF16 ? testref::decode_bf16(code) : testref::decode_f16(code));
}

// An input of `shape` to fill, with room for its values.
inline HostTensor input_of(DType dtype, const Shape& shape) {
  HostTensor t = empty_like(dtype, shape);
  t.values.resize(static_cast<size_t>(t.rows() * t.cols()));
  return t;
}

// Random input with adversarial rows, picked by row index:
//  0 random normal, 1 zeros, 2 random with NaN and +-inf sprinkled, 3 subnormal-sized values,
//  4 huge values, 5 amax 448 and e4m3 midpoints (fp8 ties when the scale is 1),
//  6 amax 127 and half-integers (int8 ties), 7 each 128-group: 7 and half-integers (int4 ties),
//  8 values within a few ulps of +-amax, 9 random bit patterns (every code, NaN and inf included).
inline HostTensor make_input(DType dtype, const Shape& shape, uint64_t seed) {
  HostTensor t = input_of(dtype, shape);
  const int64_t rows = t.rows(), cols = t.cols();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 1000);
  const auto& e4 = testref::e4m3_table().mag;
  for (int64_t r = 0; r < rows; ++r) {
    const int kind = static_cast<int>((r + static_cast<int64_t>(seed)) % 10);
    const float row_mag = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      float v = normal(rng) * row_mag;
      switch (kind) {
        case 1: v = (c % 2) ? 0.0f : -0.0f; break;
        case 2: {
          const int p = pick(rng);
          if (p < 30) v = std::nanf("");
          else if (p < 40) v = INFINITY;
          else if (p < 50) v = -INFINITY;
          else if (p < 60) v = -std::nanf("");
          break;
        }
        case 3: v = normal(rng) * 1e-41f; break;
        case 4: v = normal(rng) * 1e36f; break;
        case 5: {
          const size_t j = static_cast<size_t>(rng() % (e4.size() - 1));
          v = c == 0 ? 448.0f : to_float((e4[j] + e4[j + 1]) / 2) * ((rng() & 1) ? -1.0f : 1.0f);
          break;
        }
        case 6: v = c == 0 ? 127.0f : static_cast<float>(static_cast<int>(rng() % 254) - 127) + 0.5f; break;
        case 7: v = c % 128 == 0 ? -7.0f : static_cast<float>(static_cast<int>(rng() % 15) - 8) + 0.5f; break;
        case 8: v = std::nextafter(row_mag * 3.0f, 0.0f) * ((rng() & 1) ? -1.0f : 1.0f);
          if (c == 0) v = row_mag * 3.0f;
          break;
        case 9: {
          if (dtype == DType::kF32) {
            const uint32_t bits = static_cast<uint32_t>(rng());
            std::memcpy(&v, &bits, 4);
            std::memcpy(&t.bytes[static_cast<size_t>(i) * 4], &bits, 4);
            t.values[static_cast<size_t>(i)] = v;
          } else {
            const uint16_t bits = static_cast<uint16_t>(rng());
            std::memcpy(&t.bytes[static_cast<size_t>(i) * 2], &bits, 2);
            t.values[static_cast<size_t>(i)] =
                to_float(dtype == DType::kBF16 ? testref::decode_bf16(bits) : testref::decode_f16(bits));
          }
          continue;
        }
        default: break;
      }
      t.values[static_cast<size_t>(i)] = store_value(t, i, v);
    }
  }
  return t;
}

// Finite input whose kind changes per 128 x 128 tile (of the rows x cols view), so that whole
// fp8_block tiles take the kernels' fast paths, which make_input()'s rows (every band holds inf,
// NaN and huge values) never reach: 0 normal values of a tile magnitude from 2^-16 to 2^7, 1 zeros
// of both signs, 2 amax 448 and e4m3 midpoints (ties when the scale is 1), 3 values near 2^-30.
inline HostTensor tile_input(DType dtype, const Shape& shape, uint64_t seed) {
  HostTensor t = input_of(dtype, shape);
  const int64_t rows = t.rows(), cols = t.cols();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto& e4 = testref::e4m3_table().mag;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t br = r / 128, bc = c / 128, i = r * cols + c;
      const int kind = static_cast<int>((br * 7 + bc + static_cast<int64_t>(seed)) % 4);
      const float sign = (rng() & 1) ? -1.0f : 1.0f;
      float v = 0.0f;
      switch (kind) {
        case 0: v = normal(rng) * std::ldexp(1.0f, static_cast<int>((br * 13 + bc * 5 + static_cast<int64_t>(seed)) % 24) - 16); break;
        case 1: v = sign * 0.0f; break;
        case 2: {
          const size_t j = static_cast<size_t>(rng() % (e4.size() - 1));
          v = r % 128 == 0 && c % 128 == 0 ? 448.0f : sign * to_float((e4[j] + e4[j + 1]) / 2);
          break;
        }
        default: v = normal(rng) * 0x1p-30f; break;
      }
      t.values[static_cast<size_t>(i)] = store_value(t, i, v);
    }
  }
  return t;
}

// The element's bits as one little-endian hex number ("0x7fc1").
inline std::string bits_hex(const uint8_t* p, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (size_t j = n; j-- > 0;) {
    s += kDigits[p[j] >> 4];
    s += kDigits[p[j] & 15];
  }
  return s;
}

// Bit-for-bit comparison of two buffers of `dtype`, element by element. NaNs are compared like any
// other value: their sign and payload are part of what a scheme defines (scheme none's rule in
// kernels/quantize.h), so two different NaNs are a mismatch.
inline ::testing::AssertionResult same_bytes(DType dtype, const std::vector<uint8_t>& got,
                                             const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  const size_t es = dtype == DType::kF32 ? 4 : (dtype == DType::kBF16 || dtype == DType::kF16) ? 2 : 1;
  for (size_t i = 0; i < got.size(); i += es) {
    if (std::memcmp(&got[i], &want[i], es) == 0) continue;
    return ::testing::AssertionFailure() << "element " << i / es << " differs: got " << bits_hex(&got[i], es)
                                         << " want " << bits_hex(&want[i], es);
  }
  return ::testing::AssertionSuccess();
}

// f32 buffers equal bit for bit, except that two NaNs of the same sign match whatever their
// payloads: for dequantize, whose NaN payload no rule fixes (a GPU's arithmetic makes its own).
inline ::testing::AssertionResult same_f32_nan_sign(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); i += 4) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    const bool nan_a = (a & 0x7fffffffu) > 0x7f800000u, nan_b = (b & 0x7fffffffu) > 0x7f800000u;
    if (a == b || (nan_a && nan_b && (a >> 31) == (b >> 31))) continue;
    return ::testing::AssertionFailure() << "element " << i / 4 << " differs: got " << bits_hex(&got[i], 4)
                                         << " want " << bits_hex(&want[i], 4);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ferry::kernels::testing

// An independent reference for the quantization schemes: float64 arithmetic, rounding done by
// hand (nearest representable value found in a table of every code, ties to the even code). It
// uses none of ferry's conversion helpers, so a bug there shows up as a mismatch here.
//
// f32 division is modelled as float(double(a) / double(b)): the double quotient of two floats,
// rounded once more to float, equals the correctly rounded f32 quotient (53 >= 2 * 24 + 2 bits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ferry::kernels::testref {

inline double decode_e4m3(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  if ((c & 0x7F) == 0x7F) return std::nan("");
  if (e == 0) return sign * std::ldexp(m, -9);
  return sign * std::ldexp(8 + m, e - 10);
}

inline double decode_f16(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1F) return m ? std::copysign(std::nan(""), sign) : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

inline double decode_bf16(uint16_t b) {
  const int e = (b >> 7) & 0xFF, m = b & 0x7F;
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  if (e == 0xFF) return m ? std::copysign(std::nan(""), sign) : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -133);
  return sign * std::ldexp(128 + m, e - 134);
}

// Magnitudes of codes 0..n-1 of a format, increasing; the last entry stands for the value just
// past the largest finite one (inf for IEEE formats, so ties and overflow round as IEEE says).
struct Table {
  std::vector<double> mag;
  // Index of the nearest magnitude to `a` (>= 0), ties to the even index.
  size_t nearest(double a) const {
    auto it = std::lower_bound(mag.begin(), mag.end(), a);
    if (it == mag.end()) return mag.size() - 1;
    const size_t hi = static_cast<size_t>(it - mag.begin());
    if (hi == 0 || *it == a) return hi;
    const size_t lo = hi - 1;
    const double dlo = a - mag[lo], dhi = mag[hi] - a;
    if (dlo < dhi) return lo;
    if (dhi < dlo) return hi;
    return (lo % 2 == 0) ? lo : hi;
  }
};

inline const Table& e4m3_table() {
  static const Table t = [] {
    Table t;
    for (int c = 0; c <= 0x7E; ++c) t.mag.push_back(decode_e4m3(static_cast<uint8_t>(c)));
    return t;
  }();
  return t;
}

inline const Table& f16_table() {
  static const Table t = [] {
    Table t;
    for (int c = 0; c < 0x7C00; ++c) t.mag.push_back(decode_f16(static_cast<uint16_t>(c)));
    t.mag.push_back(65536.0);  // inf: 2^16, one ulp past 65504
    return t;
  }();
  return t;
}

inline const Table& bf16_table() {
  static const Table t = [] {
    Table t;
    for (int c = 0; c < 0x7F80; ++c) t.mag.push_back(decode_bf16(static_cast<uint16_t>(c)));
    t.mag.push_back(std::ldexp(1.0, 128));  // inf
    return t;
  }();
  return t;
}

// e4m3fn: nearest even, saturating at 448, NaN -> 0x7F (ferry drops a NaN's sign).
inline uint8_t encode_e4m3(double v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (std::isinf(v)) return sign | 0x7E;
  return static_cast<uint8_t>(sign | e4m3_table().nearest(std::fabs(v)));
}

// IEEE f16 / bf16: nearest even, overflow to inf, NaN -> the quiet NaN with the sign kept.
inline uint16_t encode_f16(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return sign | 0x7E00;
  if (std::isinf(v)) return sign | 0x7C00;
  return static_cast<uint16_t>(sign | f16_table().nearest(std::fabs(v)));
}
inline uint16_t encode_bf16(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return sign | 0x7FC0;
  if (std::isinf(v)) return sign | 0x7F80;
  return static_cast<uint16_t>(sign | bf16_table().nearest(std::fabs(v)));
}

inline float f32_div(float a, float b) { return static_cast<float>(static_cast<double>(a) / static_cast<double>(b)); }
inline float f32_mul(float a, float b) { return static_cast<float>(static_cast<double>(a) * static_cast<double>(b)); }

inline double round_half_even(double v) {
  const double fl = std::floor(v), d = v - fl;
  if (d > 0.5) return fl + 1;
  if (d < 0.5) return fl;
  return std::fmod(fl, 2.0) == 0.0 ? fl : fl + 1;
}

inline int ref_quant_int(float x, float scale, double lo, double hi) {
  double v = f32_div(x, scale);
  if (std::isnan(v)) v = 0;
  v = std::min(std::max(v, lo), hi);
  return static_cast<int>(round_half_even(v));
}

inline float amax_finite(const float* x, int64_t n, int64_t stride = 1) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = std::fabs(static_cast<double>(x[i * stride]));
    if (std::isfinite(a)) m = std::max(m, a);
  }
  return static_cast<float>(m);
}

inline float fp8_scale(float amax) {
  const float s = f32_div(amax, 448.0f);
  return s > 0 ? s : 1.0f;
}
inline float int8_scale(float amax) {
  const float s = f32_div(amax, 127.0f);
  return s > 0 ? s : 1.0f;
}
inline uint16_t int4_scale(float amax) {
  const uint16_t h = encode_f16(f32_div(amax, 7.0f));
  if (h == 0) return 0x3C00;
  if (h >= 0x7C00) return 0x7BFF;
  return h;
}

}  // namespace ferry::kernels::testref

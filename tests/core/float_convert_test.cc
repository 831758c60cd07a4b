// Checks ferry's narrow-float conversions against a reference built here from the formats'
// definitions: every code of the target format is enumerated as an exact double, and a value is
// encoded as the nearest code with ties to the even code. Nothing in the reference calls ferry.
#include "core/float_convert.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

namespace ferry {
namespace {

float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t bits_of_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// A binary float format with `e` exponent bits and `m` mantissa bits. `fn`: no infinities, the
// all-ones code is NaN, overflow saturates to the largest finite value.
struct Format {
  int e;
  int m;
  bool fn;

  int bias() const { return (1 << (e - 1)) - 1; }
  uint32_t exp_all_ones() const { return (1u << e) - 1u; }
  uint32_t man_mask() const { return (1u << m) - 1u; }
  uint32_t sign_bit() const { return 1u << (e + m); }
  // Largest magnitude code the encoder may return: infinity for IEEE formats, the largest finite
  // value for fn formats.
  uint32_t top_code() const { return fn ? (sign_bit() - 2u) : (exp_all_ones() << m); }
  bool is_nan(uint32_t code) const {
    const uint32_t mag = code & (sign_bit() - 1u);
    if (fn) return mag == sign_bit() - 1u;
    return (mag >> m) == exp_all_ones() && (mag & man_mask()) != 0;
  }
  // Exact value of a non-NaN magnitude code; the IEEE infinity code gives 2^(emax+1), which is
  // where IEEE rounding places it (overflow threshold = max + half an ulp, tie to the even inf code).
  double magnitude(uint32_t mag) const {
    const uint32_t exp = mag >> m;
    const uint32_t man = mag & man_mask();
    if (exp == 0) return std::ldexp(static_cast<double>(man), 1 - bias() - m);
    return std::ldexp(static_cast<double>((1u << m) | man), static_cast<int>(exp) - bias() - m);
  }
  // Full decode of any code, NaN included.
  double decode(uint32_t code) const {
    if (is_nan(code)) return (code & sign_bit()) ? -NAN : NAN;
    const uint32_t mag = code & (sign_bit() - 1u);
    double v = (!fn && mag == (exp_all_ones() << m)) ? INFINITY : magnitude(mag);
    return (code & sign_bit()) ? -v : v;
  }
};

constexpr Format kBF16{8, 7, false};
constexpr Format kF16{5, 10, false};
constexpr Format kE4M3FN{4, 3, true};
constexpr Format kE5M2{5, 2, false};

class Reference {
 public:
  explicit Reference(Format f) : f_(f) {
    for (uint32_t c = 0; c <= f.top_code(); ++c) values_.push_back(f.magnitude(c));
    for (size_t i = 1; i < values_.size(); ++i) {
      if (!(values_[i] > values_[i - 1])) ADD_FAILURE() << "reference values not increasing at code " << i;
    }
  }

  // Encodes a non-NaN value.
  uint32_t encode(double x) const {
    const uint32_t sign = std::signbit(x) ? f_.sign_bit() : 0u;
    const double a = std::fabs(x);
    if (std::isinf(a)) return sign | f_.top_code();  // IEEE: inf; fn: saturate
    const auto it = std::lower_bound(values_.begin(), values_.end(), a);
    if (it == values_.end()) return sign | f_.top_code();
    const auto hi = static_cast<uint32_t>(it - values_.begin());
    if (*it == a || hi == 0) return sign | hi;
    const uint32_t lo = hi - 1;
    // Exact: the two neighbours are within a factor of two of a (Sterbenz), or lo is zero.
    const double dlo = a - values_[lo];
    const double dhi = values_[hi] - a;
    if (dlo < dhi) return sign | lo;
    if (dhi < dlo) return sign | hi;
    return sign | ((lo % 2 == 0) ? lo : hi);
  }

  const Format& format() const { return f_; }

 private:
  Format f_;
  std::vector<double> values_;
};

// Compares ferry's result for f32 input `in` against the reference, NaN by the documented rule.
::testing::AssertionResult matches(const Reference& ref, float in, uint32_t got) {
  const Format& f = ref.format();
  const uint32_t in_sign = (bits_of_float(in) >> 31) ? f.sign_bit() : 0u;
  if (std::isnan(in)) {
    // IEEE formats: a quiet NaN with the input's sign. fn formats: 0x7F | sign.
    const bool ok = f.fn ? got == (in_sign | (f.sign_bit() - 1u))
                         : (f.is_nan(got) && (got & f.sign_bit()) == in_sign && (got & (1u << (f.m - 1))) != 0);
    if (ok) return ::testing::AssertionSuccess();
    std::ostringstream msg;
    msg << std::hex << "NaN input 0x" << bits_of_float(in) << " gave 0x" << got;
    return ::testing::AssertionFailure() << msg.str();
  }
  const uint32_t want = ref.encode(static_cast<double>(in));
  if (want == got) return ::testing::AssertionSuccess();
  std::ostringstream msg;
  msg << std::hex << "input 0x" << bits_of_float(in) << " (" << in << ") want 0x" << want << " got 0x" << got;
  return ::testing::AssertionFailure() << msg.str();
}

template <typename Convert>
void check_all_bf16_inputs(const Reference& ref, Convert convert) {
  int failures = 0;
  for (uint32_t code = 0; code < 65536; ++code) {
    const float in = float_of_bits(code << 16);
    const auto r = matches(ref, in, convert(in));
    if (!r && ++failures <= 10) ADD_FAILURE() << r.message();
  }
  EXPECT_EQ(failures, 0);
}

template <typename Convert>
void check_random_f32_inputs(const Reference& ref, Convert convert, int count, uint32_t seed) {
  std::mt19937 rng(seed);
  int failures = 0;
  for (int i = 0; i < count; ++i) {
    const float in = float_of_bits(static_cast<uint32_t>(rng()));
    const auto r = matches(ref, in, convert(in));
    if (!r && ++failures <= 10) ADD_FAILURE() << r.message();
  }
  EXPECT_EQ(failures, 0);
}

TEST(FloatConvert, ReferenceSelfCheck) {
  // Hand-derived values pin the reference itself.
  const Reference f16(kF16), e4m3(kE4M3FN), e5m2(kE5M2);
  EXPECT_EQ(f16.encode(65504.0), 0x7BFFu);
  EXPECT_EQ(f16.encode(65519.0), 0x7BFFu);
  EXPECT_EQ(f16.encode(65520.0), 0x7C00u);  // max + half ulp ties to infinity
  EXPECT_EQ(f16.encode(std::ldexp(1.0, -24)), 0x0001u);
  EXPECT_EQ(f16.encode(std::ldexp(1.0, -25)), 0x0000u);
  EXPECT_EQ(f16.encode(-std::ldexp(3.0, -25)), 0x8002u);
  EXPECT_EQ(e4m3.encode(448.0), 0x7Eu);
  EXPECT_EQ(e4m3.encode(464.0), 0x7Eu);
  EXPECT_EQ(e4m3.encode(1e30), 0x7Eu);
  EXPECT_EQ(e4m3.encode(-INFINITY), 0xFEu);
  EXPECT_EQ(e4m3.encode(std::ldexp(1.0, -9)), 0x01u);
  EXPECT_EQ(e4m3.encode(std::ldexp(1.0, -10)), 0x00u);
  EXPECT_EQ(e4m3.encode(std::ldexp(3.0, -10)), 0x02u);
  EXPECT_EQ(e4m3.encode(1.0), 0x38u);
  EXPECT_EQ(e5m2.encode(57344.0), 0x7Bu);
  EXPECT_EQ(e5m2.encode(61440.0), 0x7Cu);
  EXPECT_EQ(e5m2.encode(61439.0), 0x7Bu);
  EXPECT_EQ(e5m2.encode(-0.0), 0x80u);
}

TEST(FloatConvert, EveryBf16ToF16) { check_all_bf16_inputs(Reference(kF16), [](float f) { return uint32_t{f32_to_f16(f)}; }); }

TEST(FloatConvert, EveryBf16ToE4M3FN) {
  check_all_bf16_inputs(Reference(kE4M3FN), [](float f) { return uint32_t{f32_to_e4m3fn(f)}; });
}

TEST(FloatConvert, EveryBf16ToE5M2) {
  check_all_bf16_inputs(Reference(kE5M2), [](float f) { return uint32_t{f32_to_e5m2(f)}; });
}

TEST(FloatConvert, RandomF32ToBf16) {
  check_random_f32_inputs(Reference(kBF16), [](float f) { return uint32_t{f32_to_bf16(f)}; }, 2'000'000, 1);
}

TEST(FloatConvert, RandomF32ToNarrowFormats) {
  check_random_f32_inputs(Reference(kF16), [](float f) { return uint32_t{f32_to_f16(f)}; }, 500'000, 2);
  check_random_f32_inputs(Reference(kE4M3FN), [](float f) { return uint32_t{f32_to_e4m3fn(f)}; }, 500'000, 3);
  check_random_f32_inputs(Reference(kE5M2), [](float f) { return uint32_t{f32_to_e5m2(f)}; }, 500'000, 4);
}

// Random bits mostly hit huge or tiny magnitudes; these stay where the formats have their codes.
TEST(FloatConvert, RandomF32InFormatRange) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> exponent(-30.0, 18.0);
  const Reference bf16(kBF16), f16(kF16), e4m3(kE4M3FN), e5m2(kE5M2);
  int failures = 0;
  for (int i = 0; i < 500'000; ++i) {
    float in = static_cast<float>(std::exp2(exponent(rng)));
    if (rng() & 1) in = -in;
    for (auto r : {matches(bf16, in, f32_to_bf16(in)), matches(f16, in, f32_to_f16(in)),
                   matches(e4m3, in, f32_to_e4m3fn(in)), matches(e5m2, in, f32_to_e5m2(in))}) {
      if (!r && ++failures <= 10) ADD_FAILURE() << r.message();
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(FloatConvert, F32ToBf16EdgeValues) {
  struct Case {
    uint32_t in;
    uint16_t want;
  };
  const Case cases[] = {
      {0x00000000u, 0x0000}, {0x80000000u, 0x8000},  // signed zeros
      {0x3F800000u, 0x3F80}, {0x3F808000u, 0x3F80},  // tie, even stays
      {0x3F818000u, 0x3F82}, {0x3F808001u, 0x3F81},  // tie, odd rounds up; just above the tie
      {0x3F807FFFu, 0x3F80}, {0xBF818000u, 0xBF82},  // just below the tie; negative tie
      {0x3FFFFFFFu, 0x4000},                         // carry into the exponent
      {0x7F7F7FFFu, 0x7F7F}, {0x7F7F8000u, 0x7F80},  // below max + half ulp; the tie goes to inf
      {0x7F7FFFFFu, 0x7F80}, {0xFF7FFFFFu, 0xFF80},  // f32 max overflows
      {0x00000001u, 0x0000}, {0x80000001u, 0x8000},  // smallest subnormals vanish, sign kept
      {0x00008000u, 0x0000}, {0x00018000u, 0x0002},  // subnormal ties
      {0x00008001u, 0x0001}, {0x007FFFFFu, 0x0080},  // largest subnormal rounds to the smallest normal
      {0x7F800000u, 0x7F80}, {0xFF800000u, 0xFF80},  // infinities
  };
  const Reference ref(kBF16);
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_bf16(float_of_bits(c.in)), c.want) << std::hex << "input 0x" << c.in;
    EXPECT_EQ(ref.encode(static_cast<double>(float_of_bits(c.in))), c.want) << std::hex << "reference, input 0x" << c.in;
  }
  // NaN payloads, including ones that truncation would turn into infinity, stay quiet NaNs with their sign.
  for (uint32_t nan : {0x7F800001u, 0x7F80FFFFu, 0x7FBFFFFFu, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00001u,
                       0xFFFFFFFFu}) {
    const uint16_t got = f32_to_bf16(float_of_bits(nan));
    EXPECT_EQ(got & 0x7F80, 0x7F80) << std::hex << nan;
    EXPECT_NE(got & 0x0040, 0) << std::hex << "not quiet: 0x" << nan << " gave 0x" << got;
    EXPECT_EQ(got >> 15, nan >> 31) << std::hex << nan;
  }
}

TEST(FloatConvert, NarrowEdgeValues) {
  EXPECT_EQ(f32_to_e4m3fn(448.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3fn(470.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3fn(1e20f), 0x7E);
  EXPECT_EQ(f32_to_e4m3fn(-1e20f), 0xFE);
  EXPECT_EQ(f32_to_e4m3fn(INFINITY), 0x7E);
  EXPECT_EQ(f32_to_e4m3fn(-INFINITY), 0xFE);
  EXPECT_EQ(f32_to_e4m3fn(NAN), 0x7F);
  EXPECT_EQ(f32_to_e4m3fn(-NAN), 0xFF);
  EXPECT_EQ(f32_to_e4m3fn(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(f32_to_e4m3fn(std::ldexp(3.0f, -10)), 0x02);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xFC00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7C00);
  EXPECT_EQ(f32_to_e5m2(61440.0f), 0x7C);
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7B);
  EXPECT_EQ(f32_to_e5m2(-INFINITY), 0xFC);
}

template <typename Decode>
void check_decode(const Format& f, uint32_t codes, Decode decode) {
  int failures = 0;
  for (uint32_t code = 0; code < codes; ++code) {
    const double want = f.decode(code);
    const float got = decode(code);
    bool ok;
    if (std::isnan(want)) {
      ok = std::isnan(got) && std::signbit(got) == std::signbit(want);
    } else {
      ok = bits_of_float(got) == bits_of_float(static_cast<float>(want));  // every code is exact in f32
    }
    if (!ok && ++failures <= 10) ADD_FAILURE() << std::hex << "code 0x" << code << ": want " << want << " got " << got;
  }
  EXPECT_EQ(failures, 0);
}

TEST(FloatConvert, DecodeEveryE4M3FNCode) {
  check_decode(kE4M3FN, 256, [](uint32_t c) { return e4m3fn_to_f32(static_cast<uint8_t>(c)); });
  EXPECT_EQ(e4m3fn_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3fn_to_f32(0x78), 256.0f);  // the all-ones exponent is finite in the fn variant
  EXPECT_EQ(e4m3fn_to_f32(0x01), std::ldexp(1.0f, -9));
}

TEST(FloatConvert, DecodeEveryE5M2Code) {
  check_decode(kE5M2, 256, [](uint32_t c) { return e5m2_to_f32(static_cast<uint8_t>(c)); });
  EXPECT_TRUE(std::isinf(e5m2_to_f32(0x7C)));
  EXPECT_TRUE(std::isnan(e5m2_to_f32(0x7D)));
}

TEST(FloatConvert, DecodeEveryF16Code) {
  check_decode(kF16, 65536, [](uint32_t c) { return f16_to_f32(static_cast<uint16_t>(c)); });
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
}

TEST(FloatConvert, DecodeEveryBf16Code) {
  check_decode(kBF16, 65536, [](uint32_t c) { return bf16_to_f32(static_cast<uint16_t>(c)); });
}

// Narrowing the decoded value of every code gives the code back (NaNs aside).
TEST(FloatConvert, RoundTripEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    if (!kE4M3FN.is_nan(c)) {
      EXPECT_EQ(f32_to_e4m3fn(e4m3fn_to_f32(static_cast<uint8_t>(c))), c) << c;
    }
    if (!kE5M2.is_nan(c)) {
      EXPECT_EQ(f32_to_e5m2(e5m2_to_f32(static_cast<uint8_t>(c))), c) << c;
    }
  }
  for (uint32_t c = 0; c < 65536; ++c) {
    if (!kF16.is_nan(c)) {
      ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(c))), c) << c;
    }
    if (!kBF16.is_nan(c)) {
      ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(c))), c) << c;
    }
  }
}

}  // namespace
}  // namespace ferry

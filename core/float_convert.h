// Bit-exact conversions between f32 and the narrow float formats ferry stores: bf16, f16,
// fp8 e4m3fn, fp8 e5m2. Every narrowing conversion rounds to nearest, ties to even.
//  - bf16, f16, e5m2 follow IEEE 754: overflow becomes +-inf, NaN stays NaN (quiet).
//  - e4m3fn has no infinity: finite overflow and +-inf saturate to +-448, NaN becomes 0x7F|sign.
// The same code runs on the host and in CUDA kernels, so CPU and GPU results agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FERRY_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FERRY_HOST_DEVICE inline
#endif

namespace ferry {

FERRY_HOST_DEVICE uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

FERRY_HOST_DEVICE float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

namespace detail {

// v / 2^s rounded to nearest, ties to even.
FERRY_HOST_DEVICE uint32_t round_shift_rne(uint32_t v, int s) {
  if (s <= 0) return v;
  if (s >= 32) return 0;  // callers pass v < 2^31, so v / 2^s < 1/2
  const uint32_t q = v >> s;
  const uint32_t rem = v & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// Encodes f in a format with kE exponent bits and kM mantissa bits (bias 2^(kE-1)-1).
// kFn: the "fn" variant (no infinities, the all-ones code is NaN, overflow saturates).
template <int kE, int kM, bool kFn>
FERRY_HOST_DEVICE uint32_t encode_float(float f) {
  constexpr int kBias = (1 << (kE - 1)) - 1;
  constexpr uint32_t kSignShift = kE + kM;
  constexpr uint32_t kExpAllOnes = (1u << kE) - 1u;
  constexpr uint32_t kManMask = (1u << kM) - 1u;
  constexpr uint32_t kMaxFinite = kFn ? ((kExpAllOnes << kM) | (kManMask - 1u)) : (((kExpAllOnes - 1u) << kM) | kManMask);
  constexpr uint32_t kInf = kExpAllOnes << kM;
  constexpr uint32_t kNaN = kFn ? ((kExpAllOnes << kM) | kManMask) : ((kExpAllOnes << kM) | (1u << (kM - 1)));

  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 31) << kSignShift;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | kNaN;
  const int exp_field = static_cast<int>(a >> 23);
  const uint32_t mant = a & 0x7fffffu;
  const int e = (exp_field == 0 ? -126 : exp_field - 127);
  const uint32_t full = exp_field == 0 ? mant : (mant | 0x800000u);
  constexpr int kEmin = 1 - kBias;
  uint32_t q;
  if (e >= kEmin) {
    if (e + kBias >= static_cast<int>(kExpAllOnes) + 1) {
      q = 0xffffffffu;  // far beyond the largest finite value
    } else {
      // An f32 subnormal (exponent field 0) only reaches here for bf16, whose exponent range matches f32.
      const uint32_t v = (exp_field == 0 ? 0u : (static_cast<uint32_t>(e + kBias) << 23)) | mant;
      q = round_shift_rne(v, 23 - kM);
    }
  } else {
    q = round_shift_rne(full, (23 - kM) + (kEmin - e));
  }
  if (q > kMaxFinite) q = kFn ? kMaxFinite : kInf;
  return sign | q;
}

template <int kE, int kM, bool kFn>
FERRY_HOST_DEVICE float decode_float(uint32_t code) {
  constexpr int kBias = (1 << (kE - 1)) - 1;
  constexpr uint32_t kExpAllOnes = (1u << kE) - 1u;
  constexpr uint32_t kManMask = (1u << kM) - 1u;
  const uint32_t sign = ((code >> (kE + kM)) & 1u) << 31;
  const uint32_t exp = (code >> kM) & kExpAllOnes;
  const uint32_t mant = code & kManMask;
  if (kFn) {
    if (exp == kExpAllOnes && mant == kManMask) return f32_from_bits(sign | 0x7fc00000u);
  } else if (exp == kExpAllOnes) {
    return f32_from_bits(sign | (mant ? 0x7fc00000u : 0x7f800000u));
  }
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // Subnormal: mant * 2^(1 - bias - kM), normalised by hand so no library call is needed.
    int shift = 0;
    uint32_t m = mant;
    while ((m & (1u << kM)) == 0) {
      m <<= 1;
      ++shift;
    }
    const uint32_t fexp = static_cast<uint32_t>(1 - kBias - shift + 127);
    return f32_from_bits(sign | (fexp << 23) | ((m & kManMask) << (23 - kM)));
  }
  const uint32_t fexp = exp - static_cast<uint32_t>(kBias) + 127u;
  return f32_from_bits(sign | (fexp << 23) | (mant << (23 - kM)));
}

}  // namespace detail

FERRY_HOST_DEVICE float bf16_to_f32(uint16_t v) { return f32_from_bits(static_cast<uint32_t>(v) << 16); }
FERRY_HOST_DEVICE uint16_t f32_to_bf16(float f) {
  return static_cast<uint16_t>(detail::encode_float<8, 7, false>(f));
}
FERRY_HOST_DEVICE float f16_to_f32(uint16_t v) { return detail::decode_float<5, 10, false>(v); }
FERRY_HOST_DEVICE uint16_t f32_to_f16(float f) {
  return static_cast<uint16_t>(detail::encode_float<5, 10, false>(f));
}
FERRY_HOST_DEVICE float e4m3fn_to_f32(uint8_t v) { return detail::decode_float<4, 3, true>(v); }
FERRY_HOST_DEVICE uint8_t f32_to_e4m3fn(float f) {
  return static_cast<uint8_t>(detail::encode_float<4, 3, true>(f));
}
FERRY_HOST_DEVICE float e5m2_to_f32(uint8_t v) { return detail::decode_float<5, 2, false>(v); }
FERRY_HOST_DEVICE uint8_t f32_to_e5m2(float f) {
  return static_cast<uint8_t>(detail::encode_float<5, 2, false>(f));
}

inline constexpr float kE4M3Max = 448.0f;

}  // namespace ferry

// The per-element arithmetic of every scheme, shared by the CPU and CUDA kernels so that both give
// the same bits. See kernels/quantize.h for the definitions these implement.
#pragma once

#include <math.h>

#include <cstdint>

#include "core/float_convert.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#include <cuda_fp8.h>
#endif

namespace ferry::kernels::ops {

inline constexpr float kFltMax = 3.40282347e+38f;
inline constexpr uint16_t kF16One = 0x3C00;
inline constexpr uint16_t kF16Max = 0x7BFF;
inline constexpr uint16_t kF16Inf = 0x7C00;

// |x| for finite x, 0 for NaN and +-inf (they do not take part in amax).
FERRY_HOST_DEVICE float finite_abs(float x) {
  const float a = fabsf(x);
  return a <= kFltMax ? a : 0.0f;
}

FERRY_HOST_DEVICE float fp8_scale(float amax) {
  const float s = amax / 448.0f;
  return s > 0.0f ? s : 1.0f;
}

// How an engine makes an fp8 scale and its codes (kernels/quantize.h, "Engine layouts"). The
// default is ferry's own rule, which fp8_scale() and quant_fp8() above and below implement.
struct Fp8Rule {
  float amax_floor = 0.0f;         // amax = max(amax, amax_floor)
  float scale_floor = 0.0f;        // scale = max(amax / 448, scale_floor)
  bool one_if_zero = true;         // a scale that is not > 0 becomes 1
  bool reciprocal = false;         // code of x * (1 / scale) instead of x / scale
  bool zero_inverse_zero = false;  // with reciprocal: a zero scale multiplies by 0, not by 1/0
  uint8_t nan_code = 0x7F;         // the code of a NaN quotient (0x7E: clamped to +448 by fminf)
  // Codes as ferry's quant_fp8 makes them (x / scale, NaN 0x7F): only the scale may differ.
  FERRY_HOST_DEVICE bool encodes_as_ferry() const { return !reciprocal && nan_code == 0x7F; }
  // zero_inverse_zero matters only with reciprocal, so it does not tell the rules apart here.
  FERRY_HOST_DEVICE bool is_ferry() const {
    return amax_floor == 0.0f && scale_floor == 0.0f && one_if_zero && encodes_as_ferry();
  }
};

FERRY_HOST_DEVICE float fp8_scale(float amax, const Fp8Rule& r) {
  const float s = fmaxf(fmaxf(amax, r.amax_floor) / 448.0f, r.scale_floor);
  return r.one_if_zero && !(s > 0.0f) ? 1.0f : s;
}

// The multiplier of a reciprocal rule's codes (unused by a dividing one).
FERRY_HOST_DEVICE float fp8_multiplier(float scale, const Fp8Rule& r) {
  return r.zero_inverse_zero && scale == 0.0f ? 0.0f : 1.0f / scale;
}

FERRY_HOST_DEVICE float int8_scale(float amax) {
  const float s = amax / 127.0f;
  return s > 0.0f ? s : 1.0f;
}

FERRY_HOST_DEVICE uint16_t int4_scale_f16(float amax) {
  const uint16_t h = f32_to_f16(amax / 7.0f);
  return h == 0 ? kF16One : (h >= kF16Inf ? kF16Max : h);
}

// f32 -> e4m3fn, nearest even, saturating at 448, for non-NaN x (same bits as core's f32_to_e4m3fn,
// without branches so that CPU loops vectorize). Normals: rebias the exponent and round the
// mantissa with integer adds; subnormals (|x| < 2^-6): add 2^14, whose f32 ulp is the e4m3
// subnormal step 2^-9, and let the FPU round.
FERRY_HOST_DEVICE uint8_t e4m3_rne(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // Ada and Hopper convert in hardware (cvt.rn.satfinite.e4m3x2.f32): nearest even, finite values
  // saturated at 448, subnormals kept; the same bits as below for every non-NaN x (the kernels tests
  // compare CUDA with the CPU bit for bit). The integer path costs the kernels their memory speed.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t a_sat = a < 0x43E00000u ? a : 0x43E00000u;  // 448 (also +inf)
  const uint32_t normal = (a_sat - (120u << 23) + 0x7FFFFu + ((a_sat >> 20) & 1u)) >> 20;
  const uint32_t sub = f32_bits(f32_from_bits(a) + 16384.0f) - 0x46800000u;
  return static_cast<uint8_t>(sign | (a >= 0x3C800000u ? normal : sub));
#endif
}

// NaN maps to the positive e4m3fn NaN: GPUs drop a NaN's sign in arithmetic, so it is not kept on
// either side.
FERRY_HOST_DEVICE uint8_t quant_fp8(float x, float scale) {
  const float v = x / scale;
  return v == v ? e4m3_rne(v) : static_cast<uint8_t>(0x7F);
}

// quant_fp8 under an engine's rule; `inv` = fp8_multiplier(scale, r).
FERRY_HOST_DEVICE uint8_t quant_fp8(float x, float scale, float inv, const Fp8Rule& r) {
  const float v = r.reciprocal ? x * inv : x / scale;
  return v == v ? e4m3_rne(v) : r.nan_code;
}

FERRY_HOST_DEVICE int32_t quant_int(float x, float scale, float lo, float hi) {
  float v = x / scale;
  v = (v == v) ? v : 0.0f;
  v = fminf(fmaxf(v, lo), hi);
  // Nearest even for |v| <= 2^22: adding 1.5 * 2^23 leaves no fraction bits, so the FPU rounds.
  return static_cast<int32_t>((v + 12582912.0f) - 12582912.0f);
}

FERRY_HOST_DEVICE int8_t quant_int8(float x, float scale) {
  return static_cast<int8_t>(quant_int(x, scale, -127.0f, 127.0f));
}

// Sign-extends a 4-bit two's-complement code.
FERRY_HOST_DEVICE int32_t int4_value(uint32_t nibble) {
  return static_cast<int32_t>(nibble & 0xFu) - static_cast<int32_t>((nibble & 0x8u) << 1);
}

// f32 -> bf16, nearest even. core's f32_to_bf16 turns f32 subnormals into bf16 normals (it gives
// them the exponent of 2^-126), so the kernels round here instead: adding 0x7FFF plus the kept
// lsb rounds to nearest even, and the carry moves into the exponent exactly as IEEE wants
// (subnormal to normal, largest finite to inf).
FERRY_HOST_DEVICE uint16_t to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// int4_group's scale held as bf16 (Marlin's layout keeps scales in the activations' dtype):
// int4_scale_f16's rule, rounded to bf16 instead.
FERRY_HOST_DEVICE uint16_t int4_scale_bf16(float amax) {
  const uint16_t h = to_bf16(amax / 7.0f);
  return h == 0 ? uint16_t{0x3F80} : (h >= 0x7F80 ? uint16_t{0x7F7F} : h);
}

// An int4 scale held as bf16 or f16 bits: made from amax, read back, and an f16 scale converted.
FERRY_HOST_DEVICE uint16_t int4_scale_bits(float amax, bool bf16) {
  return bf16 ? int4_scale_bf16(amax) : int4_scale_f16(amax);
}
FERRY_HOST_DEVICE float scale_value(uint16_t bits, bool bf16) { return bf16 ? bf16_to_f32(bits) : f16_to_f32(bits); }
FERRY_HOST_DEVICE uint16_t f16_scale_as(uint16_t f16, bool bf16) { return bf16 ? to_bf16(f16_to_f32(f16)) : f16; }

}  // namespace ferry::kernels::ops

// Row primitives of the CPU quantize kernels: amax over a run of elements, and the per-element
// encoders over a run with one scale. Every loop is branch-free on integer bit patterns and plain
// IEEE f32 division, so GCC vectorizes it at -O3; the entry points in cpu_rows.cc are compiled for
// AVX2 and for baseline x86-64 and picked when the library loads (no -march=native: the binary
// runs on any x86-64). Same bits as the scalar definitions in scalar_ops.h.
#pragma once

#include <cstdint>

#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cpu {

// Input element types: 0 f32, 1 bf16, 2 f16 (matching with_float_dtype's three cases).
enum class In : uint8_t { kF32, kBF16, kF16 };

// amax over n elements: the largest |x| of the finite values, 0 when there is none.
float amax_f32(const float* in, int64_t n);
float amax_b16(const uint16_t* in, int64_t n, In kind);  // bf16 or f16

// out[i] = e4m3fn(in[i] / scale) as ops::quant_fp8 defines it.
void fp8_run(const void* in, In kind, uint8_t* out, int64_t n, float scale);
// out[i] = ops::quant_fp8(in[i], scale, inv, rule): an engine layout's fp8 arithmetic.
void fp8_rule_run(const void* in, In kind, uint8_t* out, int64_t n, float scale, const ops::Fp8Rule& rule);
// out[i] = ops::quant_int8(in[i], scale).
void int8_run(const void* in, In kind, int8_t* out, int64_t n, float scale);
// int4_group over `groups` consecutive 128-element groups: scales[g] (f16 bits) and the packed codes.
void int4_groups(const void* in, In kind, uint8_t* out, uint16_t* scales, int64_t groups);
// Conversion to bf16 / f32 / f16 storage (scheme none).
void to_bf16_run(const void* in, In kind, uint16_t* out, int64_t n);
void to_f16_run(const void* in, In kind, uint16_t* out, int64_t n);
void to_f32_run(const void* in, In kind, float* out, int64_t n);

inline float amax_run(const void* in, In kind, int64_t n) {
  return kind == In::kF32 ? amax_f32(static_cast<const float*>(in), n)
                          : amax_b16(static_cast<const uint16_t*>(in), n, kind);
}

inline const void* advance(const void* p, In kind, int64_t i) {
  return static_cast<const char*>(p) + i * (kind == In::kF32 ? 4 : 2);
}

}  // namespace ferry::kernels::detail::cpu

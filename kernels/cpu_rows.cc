// Vectorizable row primitives of the CPU kernels (see cpu_rows.h). The loop bodies are templates
// forced inline into the entry points, which GCC compiles three times (AVX-512, AVX2, baseline)
// through target_clones; an ifunc picks one when the library loads. The file is built with
// -ffp-contract=off (no FMA may fuse a rounding away) and -fno-trapping-math (lets GCC turn the
// selects around float ops into blends; no result changes, ferry never reads FP exception flags).
// No clones under ASan or TSan: their ifunc resolvers run before the sanitizer runtime is set up.
#include "kernels/cpu_rows.h"

#include "core/float_convert.h"
#include "kernels/scalar_ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define FERRY_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FERRY_CLONES
#endif
#define FERRY_INLINE [[gnu::always_inline]] inline

namespace ferry::kernels::detail::cpu {
namespace {

// f16 -> f32 without branches: the exponent and mantissa shifted into f32 place are the value
// times 2^-112 (normals and subnormals alike), so one exact multiply restores it. Inf stays inf;
// NaN becomes the quiet NaN with its sign, as core's f16_to_f32 gives.
FERRY_INLINE float f16_widen(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;
  const uint32_t mag = f32_bits(f32_from_bits(em << 13) * 0x1p112f);
  const uint32_t special = em > 0x7c00u ? 0x7fc00000u : 0x7f800000u;
  return f32_from_bits(sign | (em >= 0x7c00u ? special : mag));
}

template <In K>
FERRY_INLINE float widen(const void* __restrict p, int64_t i) {
  if constexpr (K == In::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (K == In::kBF16) {
    return f32_from_bits(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return f16_widen(static_cast<const uint16_t*>(p)[i]);
  }
}

// Runs LOOP<K>(args...) for the runtime input kind; the loops are always-inline templates, so each
// clone of an entry point gets its own vectorized copy.
#define FERRY_BY_KIND(kind, LOOP, ...)                          \
  switch (kind) {                                               \
    case In::kF32: LOOP<In::kF32>(__VA_ARGS__); break;   \
    case In::kBF16: LOOP<In::kBF16>(__VA_ARGS__); break; \
    case In::kF16: LOOP<In::kF16>(__VA_ARGS__); break;   \
  }

// Round half to even of v, |v| <= 2^22, as ops::quant_int does; v is clamped first, NaN to 0.
FERRY_INLINE int32_t quant_int(float x, float scale, float lo, float hi) {
  float v = x / scale;
  v = v == v ? v : 0.0f;
  v = v < lo ? lo : v;
  v = v > hi ? hi : v;
  return static_cast<int32_t>((v + 12582912.0f) - 12582912.0f);
}

// ops::quant_fp8 with the encode computed for every lane (NaN lanes then replaced): a conditional
// float add could trap in GCC's model and would keep the loop scalar.
FERRY_INLINE uint8_t quant_fp8(float x, float scale) {
  const float v = x / scale;
  const uint8_t code = ops::e4m3_rne(v);
  return v == v ? code : static_cast<uint8_t>(0x7F);
}

template <In K>
FERRY_INLINE void fp8_loop(const void* __restrict in, uint8_t* __restrict out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = quant_fp8(widen<K>(in, i), scale);
}

// The quotient (or product) and the encode for every lane, NaN lanes replaced after, as above.
template <In K, bool kReciprocal>
FERRY_INLINE void fp8_rule_loop(const void* __restrict in, uint8_t* __restrict out, int64_t n, float scale, float inv,
                                uint8_t nan_code) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = widen<K>(in, i);
    const float v = kReciprocal ? x * inv : x / scale;
    const uint8_t code = ops::e4m3_rne(v);
    out[i] = v == v ? code : nan_code;
  }
}

template <In K>
FERRY_INLINE void fp8_rule_kind(const void* in, uint8_t* out, int64_t n, float scale, const ops::Fp8Rule& r) {
  if (r.reciprocal) {
    fp8_rule_loop<K, true>(in, out, n, scale, ops::fp8_multiplier(scale, r), r.nan_code);
  } else {
    fp8_rule_loop<K, false>(in, out, n, scale, 0.0f, r.nan_code);
  }
}

template <In K>
FERRY_INLINE void int8_loop(const void* __restrict in, int8_t* __restrict out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int8_t>(quant_int(widen<K>(in, i), scale, -127.0f, 127.0f));
}

// Codes first into a small buffer, then packed in pairs: both loops vectorize, where reading even
// and odd elements in one loop would not.
template <In K>
FERRY_INLINE void int4_loop(const void* __restrict in, uint8_t* __restrict out, int64_t n, float scale) {
  constexpr int64_t kChunk = 256;
  alignas(64) int8_t codes[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = n - c0 < kChunk ? n - c0 : kChunk;
    for (int64_t i = 0; i < m; ++i) codes[i] = static_cast<int8_t>(quant_int(widen<K>(in, c0 + i), scale, -8.0f, 7.0f));
    for (int64_t i = 0; i < m / 2; ++i) {
      out[c0 / 2 + i] = static_cast<uint8_t>((codes[2 * i] & 0xF) | (codes[2 * i + 1] << 4));
    }
  }
}

// ops::to_bf16 without the branch.
template <In K>
FERRY_INLINE void bf16_loop(const void* __restrict in, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = f32_bits(widen<K>(in, i));
    const auto r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    const auto nan = static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
  }
}

// f32 -> f16, nearest even, IEEE overflow to inf, NaN to the quiet NaN with its sign (as core's
// f32_to_f16), every case computed and the right one selected. Normals: rebias and round with
// integer adds; results below 2^-14: add 0.5, whose f32 ulp is the f16 subnormal step 2^-24, and
// let the FPU round.
template <In K>
FERRY_INLINE void f16_loop(const void* __restrict in, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = f32_bits(widen<K>(in, i));
    const uint32_t a = u & 0x7fffffffu;
    const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    const uint32_t sub = f32_bits(f32_from_bits(a) + 0.5f) - 0x3F000000u;
    const uint32_t big = a > 0x7f800000u ? 0x7E00u : 0x7C00u;
    const uint32_t mag = a >= 0x47800000u ? big : (a < 0x38800000u ? sub : normal);
    out[i] = static_cast<uint16_t>(((u >> 16) & 0x8000u) | mag);
  }
}

// NaN to the quiet NaN with its sign, like the other conversions: widening a bf16 alone would keep
// its payload (a signalling NaN's too).
template <In K>
FERRY_INLINE void f32_loop(const void* __restrict in, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = f32_bits(widen<K>(in, i));
    out[i] = f32_from_bits((u & 0x7fffffffu) > 0x7f800000u ? (u & 0x80000000u) | 0x7fc00000u : u);
  }
}

// Non-negative f32 order like their bits as signed integers; inf and NaN (>= 0x7f800000) count 0.
FERRY_INLINE float amax_f32_loop(const float* __restrict in, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = static_cast<int32_t>(f32_bits(in[i]) & 0x7fffffffu);
    const int32_t f = a < 0x7f800000 ? a : 0;
    m = m > f ? m : f;
  }
  return f32_from_bits(static_cast<uint32_t>(m));
}

// bf16 and f16 magnitudes also order like their 15-bit patterns, so the max runs on 16-bit lanes.
template <In K>
FERRY_INLINE float amax_b16_loop(const uint16_t* __restrict in, int64_t n) {
  constexpr int16_t kInf = K == In::kBF16 ? int16_t{0x7f80} : int16_t{0x7c00};
  int16_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int16_t a = static_cast<int16_t>(in[i] & 0x7fffu);
    const int16_t f = a < kInf ? a : int16_t{0};
    m = m > f ? m : f;
  }
  const auto bits = static_cast<uint16_t>(m);
  return K == In::kBF16 ? f32_from_bits(static_cast<uint32_t>(bits) << 16) : f16_widen(bits);
}

template <In K>
FERRY_INLINE float amax_loop(const void* in, int64_t n) {
  if constexpr (K == In::kF32) {
    return amax_f32_loop(static_cast<const float*>(in), n);
  } else {
    return amax_b16_loop<K>(static_cast<const uint16_t*>(in), n);
  }
}

// Whole 128-column groups in one call: a call per group would cost more than the group's work.
template <In K>
FERRY_INLINE void int4_groups_loop(const void* in, uint8_t* out, uint16_t* scales, int64_t groups) {
  constexpr int64_t kG = 128;
  constexpr int64_t kSize = K == In::kF32 ? 4 : 2;
  for (int64_t g = 0; g < groups; ++g) {
    const void* at = static_cast<const char*>(in) + g * kG * kSize;
    const uint16_t s16 = ops::int4_scale_f16(amax_loop<K>(at, kG));
    scales[g] = s16;
    int4_loop<K>(at, out + g * kG / 2, kG, f16_to_f32(s16));
  }
}

}  // namespace

FERRY_CLONES float amax_f32(const float* in, int64_t n) { return amax_f32_loop(in, n); }

FERRY_CLONES float amax_b16(const uint16_t* in, int64_t n, In kind) {
  return kind == In::kBF16 ? amax_b16_loop<In::kBF16>(in, n) : amax_b16_loop<In::kF16>(in, n);
}

FERRY_CLONES void int4_groups(const void* in, In kind, uint8_t* out, uint16_t* scales, int64_t groups) {
  FERRY_BY_KIND(kind, int4_groups_loop, in, out, scales, groups)
}

FERRY_CLONES void fp8_run(const void* in, In kind, uint8_t* out, int64_t n, float scale) {
  FERRY_BY_KIND(kind, fp8_loop, in, out, n, scale)
}
FERRY_CLONES void fp8_rule_run(const void* in, In kind, uint8_t* out, int64_t n, float scale,
                               const ops::Fp8Rule& rule) {
  FERRY_BY_KIND(kind, fp8_rule_kind, in, out, n, scale, rule)
}
FERRY_CLONES void int8_run(const void* in, In kind, int8_t* out, int64_t n, float scale) {
  FERRY_BY_KIND(kind, int8_loop, in, out, n, scale)
}
FERRY_CLONES void to_bf16_run(const void* in, In kind, uint16_t* out, int64_t n) {
  FERRY_BY_KIND(kind, bf16_loop, in, out, n)
}
FERRY_CLONES void to_f16_run(const void* in, In kind, uint16_t* out, int64_t n) {
  FERRY_BY_KIND(kind, f16_loop, in, out, n)
}
FERRY_CLONES void to_f32_run(const void* in, In kind, float* out, int64_t n) {
  FERRY_BY_KIND(kind, f32_loop, in, out, n)
}

}  // namespace ferry::kernels::detail::cpu

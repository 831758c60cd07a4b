// Helpers of the CPU kernels: typed element loads and the choice of a parallel grain.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "core/float_convert.h"

namespace ferry::kernels::detail::cpu {

// Elements per worker below which splitting across threads costs more than it saves.
inline constexpr int64_t kMinElemsPerWorker = 1 << 18;

inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kMinElemsPerWorker / std::max<int64_t>(cols, 1)); }

template <DType D>
inline float load(const void* p, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  } else {
    static_assert(D == DType::kF16);
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

// Calls fn(std::integral_constant<DType, D>{}) for the float input dtype `dt` (f32, bf16, f16).
template <typename Fn>
inline void with_float_dtype(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kBF16: fn(std::integral_constant<DType, DType::kBF16>{}); break;
    case DType::kF16: fn(std::integral_constant<DType, DType::kF16>{}); break;
    default: fn(std::integral_constant<DType, DType::kF32>{}); break;
  }
}

}  // namespace ferry::kernels::detail::cpu

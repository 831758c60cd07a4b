// Element types ferry moves and stores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/status.h"

namespace ferry {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kF8E4M3FN,
  kF8E5M2,
  kI8,
  kU8,
  kI32,
  kI64,
  kI4Packed,  // two signed 4-bit values per byte, element 2k in the low nibble
};

inline constexpr DType kAllDTypes[] = {DType::kF32, DType::kF16,  DType::kBF16, DType::kF8E4M3FN,
                                       DType::kF8E5M2, DType::kI8, DType::kU8,  DType::kI32,
                                       DType::kI64, DType::kI4Packed};

// Bits per element (4 for packed int4).
int dtype_bits(DType dt);
// Bytes that `numel` elements occupy (rounded up for packed int4).
size_t dtype_bytes(DType dt, int64_t numel);
std::string_view dtype_name(DType dt);
Result<DType> parse_dtype(std::string_view name);

}  // namespace ferry

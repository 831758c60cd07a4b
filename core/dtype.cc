#include "core/dtype.h"

#include <string>

namespace ferry {

int dtype_bits(DType dt) {
  switch (dt) {
    case DType::kF32: return 32;
    case DType::kF16: return 16;
    case DType::kBF16: return 16;
    case DType::kF8E4M3FN: return 8;
    case DType::kF8E5M2: return 8;
    case DType::kI8: return 8;
    case DType::kU8: return 8;
    case DType::kI32: return 32;
    case DType::kI64: return 64;
    case DType::kI4Packed: return 4;
  }
  return 0;
}

size_t dtype_bytes(DType dt, int64_t numel) {
  if (numel <= 0) return 0;
  return (static_cast<size_t>(numel) * static_cast<size_t>(dtype_bits(dt)) + 7) / 8;
}

std::string_view dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3FN: return "f8_e4m3fn";
    case DType::kF8E5M2: return "f8_e5m2";
    case DType::kI8: return "i8";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kI4Packed: return "i4x2";
  }
  return "unknown";
}

Result<DType> parse_dtype(std::string_view name) {
  for (DType dt : kAllDTypes) {
    if (dtype_name(dt) == name) return dt;
  }
  return Status::invalid_argument("unknown dtype '" + std::string(name) +
                                  "' (expected one of f32 f16 bf16 f8_e4m3fn f8_e5m2 i8 u8 i32 i64 i4x2)");
}

}  // namespace ferry

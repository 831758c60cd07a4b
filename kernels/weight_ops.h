// One stored weight element, dequantized: shared by dequantize and the GEMMs on CPU and CUDA.
#pragma once

#include <cstdint>

#include "core/float_convert.h"
#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail {

// Plain-data view of WeightArgs that can be passed to a CUDA kernel by value.
struct WeightRef {
  Scheme scheme = Scheme::kNone;
  DType w_dtype = DType::kF32;
  const void* w = nullptr;
  const void* scale = nullptr;
  int64_t rows = 0;         // all rows of all stacked matrices
  int64_t matrix_rows = 0;  // rows of one stacked matrix
  int64_t cols = 0;
  int32_t shards = 1;
  int64_t shard_begin[kMaxShards + 1] = {};
  const int32_t* perm = nullptr;
};

inline WeightRef make_weight_ref(const WeightArgs& a) {
  WeightRef r;
  r.scheme = a.scheme;
  r.w_dtype = a.w_dtype;
  r.w = a.w;
  r.scale = a.scale;
  r.rows = a.rows;
  r.matrix_rows = a.matrix_rows;
  r.cols = a.cols;
  r.shards = static_cast<int32_t>(a.shard_begin.size() - 1);
  for (size_t i = 0; i < a.shard_begin.size(); ++i) r.shard_begin[i] = a.shard_begin[i];
  r.perm = a.perm;
  return r;
}

// Element (r, c) of the stored weight as f32. For gptq_int4, r is the output column n and c the
// sorted input row k' (the GEMM gathers x through perm); for the other schemes (r, c) is logical.
FERRY_HOST_DEVICE float weight_at(const WeightRef& w, int64_t r, int64_t c) {
  const int64_t i = r * w.cols + c;
  switch (w.scheme) {
    case Scheme::kNone:
      if (w.w_dtype == DType::kF32) return static_cast<const float*>(w.w)[i];
      if (w.w_dtype == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(w.w)[i]);
      return f16_to_f32(static_cast<const uint16_t*>(w.w)[i]);
    case Scheme::kFp8PerTensor: {
      int32_t s = 0;
      while (s + 1 < w.shards && r >= w.shard_begin[s + 1]) ++s;
      return e4m3fn_to_f32(static_cast<const uint8_t*>(w.w)[i]) * static_cast<const float*>(w.scale)[s];
    }
    case Scheme::kFp8PerChannel:
      return e4m3fn_to_f32(static_cast<const uint8_t*>(w.w)[i]) * static_cast<const float*>(w.scale)[r];
    case Scheme::kFp8Block: {
      // Bands restart at every stacked matrix: row r is row r % matrix_rows of matrix r / matrix_rows.
      const int64_t bcols = (w.cols + kFp8BlockSize - 1) / kFp8BlockSize;
      const int64_t bands = (w.matrix_rows + kFp8BlockSize - 1) / kFp8BlockSize;
      const int64_t band = (r / w.matrix_rows) * bands + (r % w.matrix_rows) / kFp8BlockSize;
      const float s = static_cast<const float*>(w.scale)[band * bcols + c / kFp8BlockSize];
      return e4m3fn_to_f32(static_cast<const uint8_t*>(w.w)[i]) * s;
    }
    case Scheme::kInt8PerChannel:
      return static_cast<float>(static_cast<const int8_t*>(w.w)[i]) * static_cast<const float*>(w.scale)[r];
    case Scheme::kInt4Group: {
      const uint8_t byte = static_cast<const uint8_t*>(w.w)[i / 2];
      const int32_t q = ops::int4_value((i & 1) ? (byte >> 4) : byte);
      const uint16_t s = static_cast<const uint16_t*>(w.scale)[r * (w.cols / kGroupSize) + c / kGroupSize];
      return static_cast<float>(q) * f16_to_f32(s);
    }
    case Scheme::kGptqInt4: {
      // Sorted qweight i32[K/8, N]; r = n, c = k'.
      const uint32_t word = static_cast<uint32_t>(static_cast<const int32_t*>(w.w)[(c / kGptqPackFactor) * w.rows + r]);
      const int32_t q = static_cast<int32_t>((word >> (4 * (c % kGptqPackFactor))) & 0xFu) - static_cast<int32_t>(kGptqZeroPoint);
      const uint16_t s = static_cast<const uint16_t*>(w.scale)[(c / kGroupSize) * w.rows + r];
      return static_cast<float>(q) * f16_to_f32(s);
    }
  }
  return 0.0f;
}

}  // namespace ferry::kernels::detail

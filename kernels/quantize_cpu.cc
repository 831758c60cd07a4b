// CPU quantize kernels for the online schemes. Rows (or 128-row bands) are split across threads;
// each worker reads its rows once for amax and once more, from cache, to quantize.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu_common.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cpu {
namespace {

using detail::parallel_for;
using detail::QuantArgs;

// Non-negative floats order like their bit patterns, so the max runs on integers (vectorizes).
template <DType D>
float amax_of(const void* in, int64_t begin, int64_t end) {
  uint32_t m = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t a = f32_bits(load<D>(in, i)) & 0x7fffffffu;
    m = std::max(m, a < 0x7f800000u ? a : 0u);
  }
  return f32_from_bits(m);
}

template <DType D>
void fp8_range(const void* in, uint8_t* out, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) out[i] = ops::quant_fp8(load<D>(in, i), scale);
}

template <DType D>
void none(const QuantArgs& a, int threads) {
  const int64_t n = a.rows * a.cols;
  if (a.out_dtype == D) {
    const size_t esize = dtype_bytes(D, 1);
    parallel_for(n, kMinElemsPerWorker * 4, threads, [&](int64_t b, int64_t e) {
      std::memcpy(static_cast<char*>(a.out) + b * esize, static_cast<const char*>(a.in) + b * esize,
                  static_cast<size_t>(e - b) * esize);
    });
    return;
  }
  parallel_for(n, kMinElemsPerWorker, threads, [&](int64_t b, int64_t e) {
    if (a.out_dtype == DType::kF32) {
      float* out = static_cast<float*>(a.out);
      for (int64_t i = b; i < e; ++i) out[i] = load<D>(a.in, i);
    } else if (a.out_dtype == DType::kBF16) {
      uint16_t* out = static_cast<uint16_t*>(a.out);
      for (int64_t i = b; i < e; ++i) out[i] = ops::to_bf16(load<D>(a.in, i));
    } else {
      uint16_t* out = static_cast<uint16_t*>(a.out);
      for (int64_t i = b; i < e; ++i) out[i] = f32_to_f16(load<D>(a.in, i));
    }
  });
}

template <DType D>
void fp8_per_tensor(const QuantArgs& a, int threads) {
  const int64_t cols = a.cols;
  std::vector<float> row_amax(static_cast<size_t>(a.rows));
  parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) row_amax[static_cast<size_t>(r)] = amax_of<D>(a.in, r * cols, (r + 1) * cols);
  });
  const size_t shards = a.shard_begin.size() - 1;
  std::vector<float> row_scale(static_cast<size_t>(a.rows));
  float* scale = static_cast<float*>(a.scale);
  for (size_t s = 0; s < shards; ++s) {
    float m = 0.0f;
    for (int64_t r = a.shard_begin[s]; r < a.shard_begin[s + 1]; ++r) m = std::max(m, row_amax[static_cast<size_t>(r)]);
    scale[s] = ops::fp8_scale(m);
    for (int64_t r = a.shard_begin[s]; r < a.shard_begin[s + 1]; ++r) row_scale[static_cast<size_t>(r)] = scale[s];
  }
  uint8_t* out = static_cast<uint8_t*>(a.out);
  parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) fp8_range<D>(a.in, out, r * cols, (r + 1) * cols, row_scale[static_cast<size_t>(r)]);
  });
}

template <DType D>
void fp8_per_channel(const QuantArgs& a, int threads) {
  const int64_t cols = a.cols;
  uint8_t* out = static_cast<uint8_t*>(a.out);
  float* scale = static_cast<float*>(a.scale);
  parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float s = ops::fp8_scale(amax_of<D>(a.in, r * cols, (r + 1) * cols));
      scale[r] = s;
      fp8_range<D>(a.in, out, r * cols, (r + 1) * cols, s);
    }
  });
}

template <DType D>
void fp8_block(const QuantArgs& a, int threads) {
  const int64_t rows = a.rows, cols = a.cols;
  const int64_t bands = (rows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t bcols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  uint8_t* out = static_cast<uint8_t*>(a.out);
  float* scale = static_cast<float*>(a.scale);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerWorker / std::max<int64_t>(1, kFp8BlockSize * cols));
  parallel_for(bands, grain, threads, [&](int64_t b, int64_t e) {
    for (int64_t band = b; band < e; ++band) {
      const int64_t r0 = band * kFp8BlockSize, r1 = std::min(rows, r0 + kFp8BlockSize);
      for (int64_t bc = 0; bc < bcols; ++bc) {
        const int64_t c0 = bc * kFp8BlockSize, c1 = std::min(cols, c0 + kFp8BlockSize);
        float m = 0.0f;
        for (int64_t r = r0; r < r1; ++r) m = std::max(m, amax_of<D>(a.in, r * cols + c0, r * cols + c1));
        const float s = ops::fp8_scale(m);
        scale[band * bcols + bc] = s;
        for (int64_t r = r0; r < r1; ++r) fp8_range<D>(a.in, out, r * cols + c0, r * cols + c1, s);
      }
    }
  });
}

template <DType D>
void int8_per_channel(const QuantArgs& a, int threads) {
  const int64_t cols = a.cols;
  int8_t* out = static_cast<int8_t*>(a.out);
  float* scale = static_cast<float*>(a.scale);
  parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float s = ops::int8_scale(amax_of<D>(a.in, r * cols, (r + 1) * cols));
      scale[r] = s;
      for (int64_t i = r * cols; i < (r + 1) * cols; ++i) out[i] = ops::quant_int8(load<D>(a.in, i), s);
    }
  });
}

template <DType D>
void int4_group(const QuantArgs& a, int threads) {
  const int64_t cols = a.cols, groups = cols / kInt4GroupSize;
  uint8_t* out = static_cast<uint8_t*>(a.out);
  uint16_t* scale = static_cast<uint16_t*>(a.scale);
  parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t base = r * cols + g * kInt4GroupSize;
        const uint16_t s16 = ops::int4_scale_f16(amax_of<D>(a.in, base, base + kInt4GroupSize));
        scale[r * groups + g] = s16;
        const float s = f16_to_f32(s16);
        for (int64_t i = base; i < base + kInt4GroupSize; i += 2) {
          const uint8_t lo = ops::quant_int4(load<D>(a.in, i), s);
          const uint8_t hi = ops::quant_int4(load<D>(a.in, i + 1), s);
          out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    }
  });
}

}  // namespace

Status quantize(const QuantArgs& a, int threads) {
  with_float_dtype(a.in_dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    switch (a.scheme) {
      case Scheme::kNone: none<D>(a, threads); break;
      case Scheme::kFp8PerTensor: fp8_per_tensor<D>(a, threads); break;
      case Scheme::kFp8PerChannel: fp8_per_channel<D>(a, threads); break;
      case Scheme::kFp8Block: fp8_block<D>(a, threads); break;
      case Scheme::kInt8PerChannel: int8_per_channel<D>(a, threads); break;
      case Scheme::kInt4Group: int4_group<D>(a, threads); break;
      case Scheme::kGptqInt4: break;  // refused by check_quantize
    }
  });
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

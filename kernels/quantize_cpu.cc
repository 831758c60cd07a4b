// CPU quantize kernels for the online schemes. Rows (128-row bands, 128-column groups) are split
// across threads; each worker reads a row once for amax and once more, from cache, to quantize. The
// element loops are the vectorized run primitives of cpu_rows.h.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu_common.h"
#include "kernels/cpu_rows.h"
#include "kernels/internal.h"
#include "kernels/quantize.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cpu {
namespace {

using detail::parallel_for;
using detail::QuantArgs;

constexpr In kind_of(DType d) { return d == DType::kF32 ? In::kF32 : d == DType::kBF16 ? In::kBF16 : In::kF16; }

// Rows [b, e) of `cols` elements: element offsets and pointers into the input.
struct Rows {
  const void* in;
  In kind;
  int64_t cols;
  const void* at(int64_t i) const { return advance(in, kind, i); }
  float amax(int64_t i, int64_t n) const { return amax_run(at(i), kind, n); }
};

// The codes of n elements from element i of `in` with one scale, by the arguments' fp8 rule.
void fp8_codes(const Rows& in, int64_t i, uint8_t* out, int64_t n, float scale, const ops::Fp8Rule& r) {
  if (r.encodes_as_ferry()) {
    fp8_run(in.at(i), in.kind, out, n, scale);
  } else {
    fp8_rule_run(in.at(i), in.kind, out, n, scale, r);
  }
}

void none(const QuantArgs& a, int threads) {
  const int64_t n = a.rows * a.cols;
  const In kind = kind_of(a.in_dtype);
  if (a.out_dtype == a.in_dtype) {
    const size_t esize = dtype_bytes(a.in_dtype, 1);
    parallel_for(n, kMinElemsPerWorker * 4, threads, [&](int64_t b, int64_t e) {
      std::memcpy(static_cast<char*>(a.out) + b * esize, static_cast<const char*>(a.in) + b * esize,
                  static_cast<size_t>(e - b) * esize);
    });
    return;
  }
  parallel_for(n, kMinElemsPerWorker, threads, [&](int64_t b, int64_t e) {
    const void* in = advance(a.in, kind, b);
    if (a.out_dtype == DType::kF32) {
      to_f32_run(in, kind, static_cast<float*>(a.out) + b, e - b);
    } else if (a.out_dtype == DType::kBF16) {
      to_bf16_run(in, kind, static_cast<uint16_t*>(a.out) + b, e - b);
    } else {
      to_f16_run(in, kind, static_cast<uint16_t*>(a.out) + b, e - b);
    }
  });
}

// The scale of every shard of `a` (amax over its rows, rows split across threads).
std::vector<float> shard_scales(const QuantArgs& a, int threads) {
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  std::vector<float> row_amax(static_cast<size_t>(a.rows));
  parallel_for(a.rows, row_grain(a.cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) row_amax[static_cast<size_t>(r)] = in.amax(r * a.cols, a.cols);
  });
  std::vector<float> out(a.shard_begin.size() - 1);
  for (size_t s = 0; s < out.size(); ++s) {
    float m = 0.0f;
    for (int64_t r = a.shard_begin[s]; r < a.shard_begin[s + 1]; ++r) m = std::max(m, row_amax[static_cast<size_t>(r)]);
    out[s] = ops::fp8_scale(m, a.fp8);
  }
  return out;
}

void fp8_per_tensor(const QuantArgs& a, int threads) {
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  const std::vector<float> scales = shard_scales(a, threads);
  std::vector<float> row_scale(static_cast<size_t>(a.rows));
  float* scale = static_cast<float*>(a.scale);
  for (size_t s = 0; s < scales.size(); ++s) {
    scale[s] = scales[s];
    for (int64_t r = a.shard_begin[s]; r < a.shard_begin[s + 1]; ++r) row_scale[static_cast<size_t>(r)] = scale[s];
  }
  uint8_t* out = static_cast<uint8_t*>(a.out);
  // Rows of one scale are contiguous: quantize each worker's range in runs of equal scale.
  parallel_for(a.rows, row_grain(a.cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e;) {
      int64_t r1 = r + 1;
      while (r1 < e && row_scale[static_cast<size_t>(r1)] == row_scale[static_cast<size_t>(r)]) ++r1;
      fp8_codes(in, r * a.cols, out + r * a.cols, (r1 - r) * a.cols, row_scale[static_cast<size_t>(r)], a.fp8);
      r = r1;
    }
  });
}

// fp8_per_channel and int8_per_channel: amax of a row, then the row again from cache.
template <bool kInt8>
void per_channel(const QuantArgs& a, int threads) {
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  float* scale = static_cast<float*>(a.scale);
  parallel_for(a.rows, row_grain(a.cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = r * a.cols;
      const float m = in.amax(i, a.cols);
      if constexpr (kInt8) {
        scale[r] = ops::int8_scale(m);
        int8_run(in.at(i), in.kind, static_cast<int8_t*>(a.out) + i, a.cols, scale[r]);
      } else {
        scale[r] = ops::fp8_scale(m, a.fp8);
        fp8_codes(in, i, static_cast<uint8_t*>(a.out) + i, a.cols, scale[r], a.fp8);
      }
    }
  });
}

// 128-row bands; bands restart at every stacked matrix.
void fp8_block(const QuantArgs& a, int threads) {
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  const int64_t mrows = a.matrix_rows, cols = a.cols;
  const int64_t batch = mrows > 0 ? a.rows / mrows : 0;
  const int64_t bands_per = (mrows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t bcols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  uint8_t* out = static_cast<uint8_t*>(a.out);
  float* scale = static_cast<float*>(a.scale);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerWorker / std::max<int64_t>(1, kFp8BlockSize * cols));
  parallel_for(batch * bands_per, grain, threads, [&](int64_t b, int64_t e) {
    std::vector<float> m(static_cast<size_t>(bcols));
    for (int64_t band = b; band < e; ++band) {
      const int64_t mat = band / bands_per;
      const int64_t r0 = mat * mrows + (band % bands_per) * kFp8BlockSize;
      const int64_t r1 = std::min(mat * mrows + mrows, r0 + kFp8BlockSize);
      std::fill(m.begin(), m.end(), 0.0f);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t bc = 0; bc < bcols; ++bc) {
          const int64_t c0 = bc * kFp8BlockSize, n = std::min(cols - c0, kFp8BlockSize);
          m[static_cast<size_t>(bc)] = std::max(m[static_cast<size_t>(bc)], in.amax(r * cols + c0, n));
        }
      }
      for (int64_t bc = 0; bc < bcols; ++bc) {
        m[static_cast<size_t>(bc)] = ops::fp8_scale(m[static_cast<size_t>(bc)], a.fp8);
        scale[band * bcols + bc] = m[static_cast<size_t>(bc)];
      }
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t bc = 0; bc < bcols; ++bc) {
          const int64_t i = r * cols + bc * kFp8BlockSize, n = std::min(cols - bc * kFp8BlockSize, kFp8BlockSize);
          fp8_codes(in, i, out + i, n, m[static_cast<size_t>(bc)], a.fp8);
        }
      }
    }
  });
}

void int4_group(const QuantArgs& a, int threads) {
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  const int64_t groups = a.rows * (a.cols / kGroupSize);
  uint8_t* out = static_cast<uint8_t*>(a.out);
  uint16_t* scale = static_cast<uint16_t*>(a.scale);
  parallel_for(groups, std::max<int64_t>(1, kMinElemsPerWorker / kGroupSize), threads, [&](int64_t b, int64_t e) {
    // Groups tile the rows exactly (cols % 128 == 0).
    int4_groups(in.at(b * kGroupSize), in.kind, out + b * kGroupSize / 2, scale + b, e - b);
  });
}

}  // namespace

int64_t fp8_per_tensor_rows(const QuantArgs& a, std::span<const std::pair<int64_t, int64_t>> rows, int threads) {
  const std::vector<float> scales = shard_scales(a, threads);
  float* stored = static_cast<float*>(a.scale);
  const Rows in{a.in, kind_of(a.in_dtype), a.cols};
  uint8_t* out = static_cast<uint8_t*>(a.out);
  const auto codes = [&](int64_t r0, int64_t r1, float scale) {
    parallel_for(r1 - r0, row_grain(a.cols), threads, [&](int64_t b, int64_t e) {
      fp8_codes(in, (r0 + b) * a.cols, out + (r0 + b) * a.cols, (e - b) * a.cols, scale, a.fp8);
    });
  };
  // A shard whose scale comes out bit for bit as stored (what these values made last time) keeps
  // it, and only its changed rows get codes; any other shard is quantized whole.
  std::vector<bool> moved(scales.size());
  int64_t written = 0;
  for (size_t s = 0; s < scales.size(); ++s) {
    moved[s] = std::memcmp(&scales[s], &stored[s], sizeof(float)) != 0;
    if (!moved[s]) continue;
    stored[s] = scales[s];
    codes(a.shard_begin[s], a.shard_begin[s + 1], scales[s]);
    written += a.shard_begin[s + 1] - a.shard_begin[s];
  }
  size_t s = 0;
  for (auto [r, r1] : rows) {
    while (r < r1) {  // a run may cross shards: each part with its shard's scale
      while (a.shard_begin[s + 1] <= r) ++s;
      const int64_t end = std::min(r1, a.shard_begin[s + 1]);
      if (!moved[s]) {
        codes(r, end, scales[s]);
        written += end - r;
      }
      r = end;
    }
  }
  return written;
}

Status quantize(const QuantArgs& a, int threads) {
  switch (a.scheme) {
    case Scheme::kNone: none(a, threads); break;
    case Scheme::kFp8PerTensor: fp8_per_tensor(a, threads); break;
    case Scheme::kFp8PerChannel: per_channel<false>(a, threads); break;
    case Scheme::kFp8Block: fp8_block(a, threads); break;
    case Scheme::kInt8PerChannel: per_channel<true>(a, threads); break;
    case Scheme::kInt4Group: int4_group(a, threads); break;
    case Scheme::kGptqInt4: break;  // refused by check_quantize
  }
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

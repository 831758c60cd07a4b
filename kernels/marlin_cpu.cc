// CPU int4_group into Marlin's layout (kernels/marlin_layout.h): the group scales first, each into
// its permuted place, then every packed word gathered from its eight weight elements.
#include <algorithm>
#include <array>

#include "kernels/cpu_common.h"
#include "kernels/cpu_rows.h"
#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/marlin_layout.h"

namespace ferry::kernels::detail::cpu {
namespace {

// get_weight_perm(4), tabulated once.
const std::array<int, marlin::kPermChunk>& weight_perm_table() {
  static const std::array<int, marlin::kPermChunk> table = [] {
    std::array<int, marlin::kPermChunk> t{};
    for (int j = 0; j < marlin::kPermChunk; ++j) t[j] = marlin::weight_perm(j);
    return t;
  }();
  return table;
}

// Writes every word of columns [c0, c1) of `rows_of_words` rows of `words` words each (a matrix's
// K / 16 rows, after one another for stacked matrices), word (r, c) from nibble(r % tiles, n, k),
// n and k the weight element (output, input) of its nibble q.
template <typename Nibble>
void marlin_words(int64_t rows_of_words, int64_t tiles, int64_t words, int64_t c0, int64_t c1, int32_t* out,
                  int threads, const Nibble& nibble) {
  const auto& perm = weight_perm_table();
  parallel_for(rows_of_words, std::max<int64_t>(1, kMinElemsPerWorker / (8 * (c1 - c0))), threads,
               [&](int64_t b, int64_t e) {
                 for (int64_t t = b; t < e; ++t) {
                   const int64_t r = t % tiles;
                   for (int64_t c = c0; c < c1; ++c) {
                     uint32_t word = 0;
                     for (int q = 0; q < 8; ++q) {
                       const int64_t p = 8 * c + q;
                       int64_t n;
                       int kk;
                       marlin::word_element(p, perm[p & (marlin::kPermChunk - 1)], n, kk);
                       word |= (nibble(t, n, r * marlin::kTile + kk) & 0xFu) << (4 * q);
                     }
                     out[t * words + c] = static_cast<int32_t>(word);
                   }
                 }
               });
}

template <DType D>
void marlin_codes(const MarlinArgs& a, int threads) {
  const int64_t k = a.k, groups = k / kGroupSize, tiles = k / marlin::kTile;
  const auto* in = static_cast<const char*>(a.in);
  const size_t elem = dtype_bytes(D, 1);
  // The words of outputs [n0, n0 + n) of every matrix.
  marlin_words(a.batch * tiles, tiles, 2 * a.n_total, 2 * a.n0, 2 * (a.n0 + a.n), a.out, threads,
               [&](int64_t t, int64_t col, int64_t row) {
                 const int64_t m = t / tiles;
                 const void* x = in + elem * static_cast<size_t>(m * a.n * k);
                 const uint16_t s =
                     a.scale[m * groups * a.n_total + marlin::scale_index(row / kGroupSize, col, groups, a.n_total)];
                 const float scale = ops::scale_value(s, a.scale_bf16);
                 const int32_t code = ops::quant_int(load<D>(x, (col - a.n0) * k + row), scale, -8.0f, 7.0f);
                 return static_cast<uint32_t>(code + static_cast<int32_t>(marlin::kZeroPoint));
               });
}

}  // namespace

Status marlin_quantize(const MarlinArgs& a, int threads) {
  const int64_t groups = a.k / kGroupSize;
  const In kind = a.in_dtype == DType::kF32 ? In::kF32 : a.in_dtype == DType::kBF16 ? In::kBF16 : In::kF16;
  parallel_for(a.batch * a.n, row_grain(a.k), threads, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t m = row / a.n, col = a.n0 + row % a.n;
      for (int64_t g = 0; g < groups; ++g) {
        const float amax = amax_run(advance(a.in, kind, row * a.k + g * kGroupSize), kind, kGroupSize);
        a.scale[m * groups * a.n_total + marlin::scale_index(g, col, groups, a.n_total)] =
            ops::int4_scale_bits(amax, a.scale_bf16);
      }
    }
  });
  with_float_dtype(a.in_dtype, [&](auto d) { marlin_codes<decltype(d)::value>(a, threads); });
  return ok_status();
}

Status gptq_marlin(const GptqArgs& a, std::span<const int32_t> perm, int threads) {
  const int64_t n = a.n, k = a.k, groups = k / kGroupSize, tiles = k / marlin::kTile;
  // gptq_marlin_repack(qweight, perm): sorted input k' is checkpoint row perm[k'], whose code (already
  // uint4b8, zero point 8) lies in word k / 8 of its column.
  marlin_words(tiles, tiles, 2 * n, 0, 2 * n, a.out_qweight, threads, [&](int64_t, int64_t col, int64_t row) {
    const int64_t src = perm[static_cast<size_t>(row)];
    return static_cast<uint32_t>(a.qweight[(src / kGptqPackFactor) * n + col]) >> (4 * (src % kGptqPackFactor));
  });
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t col = 0; col < n; ++col) {
      const uint16_t h = a.scales[g * n + col];
      a.out_scales[marlin::scale_index(g, col, groups, n)] = ops::f16_scale_as(h, a.scale_bf16);
    }
  }
  for (int64_t i = 0; i < k; ++i) {
    a.perm[i] = perm[static_cast<size_t>(i)];
    a.out_g_idx[i] = a.g_idx[perm[static_cast<size_t>(i)]];
  }
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

// Marlin's int4 layout, which vLLM's and SGLang's W4A16 kernels read (docs/engines.md cites the
// source): where each code and each group scale of a [N, K] weight (N outputs, K inputs) lies in
// the repacked storage. Shared by the CPU and CUDA kernels, which gather each packed word from the
// weight rather than permuting a copy.
//
// Definitions (vLLM marlin_utils_test.py marlin_weights / get_weight_perm, marlin_utils.py
// marlin_permute_scales; the same as the gptq_marlin_repack kernel):
//   - the codes, as the [K, N] matrix q[k, n] (unsigned, uint4b8: code + 8), are cut into 16 x 16
//     tiles; row r of the repacked weight holds the tiles of k in [16r, 16r + 16), tile after tile
//     along n, each tile row-major (element (kk, nn) at 16 kk + nn of its 256);
//   - every 1024 consecutive elements of such a row are permuted: position j takes element
//     perm[j] of its chunk (get_weight_perm(4), interleaved by [0, 2, 4, 6, 1, 3, 5, 7]);
//   - eight consecutive elements pack into one 32-bit word, the first in the low nibble:
//     weight i32[K / 16, 2 N];
//   - scales [K / 128, N] in 64-column chunks permuted by scale_perm (perm[8 i + j] = i + 8 j), or,
//     when one group spans all of K, in 32-column chunks by scale_perm_single.
#pragma once

#include <cstdint>

#include "core/float_convert.h"

namespace ferry::kernels::marlin {

inline constexpr int64_t kTile = 16;
inline constexpr int64_t kPermChunk = 1024;  // 16 inputs x kChunkN outputs
inline constexpr int64_t kChunkN = 64;
inline constexpr int64_t kMinN = 64;       // GPTQ_MARLIN_MIN_THREAD_N: N per partition a multiple of it
inline constexpr int64_t kMinK = 128;      // GPTQ_MARLIN_MIN_THREAD_K
inline constexpr uint32_t kZeroPoint = 8;  // uint4b8: the stored nibble is code + 8

// get_weight_perm(4)[j]: the element of a 1024-chunk that position j takes. Before interleaving,
// index 32 i + 8 m + 4 b + t (i < 32, m < 4, b < 2, t < 4) holds 16 row + i / 4 + 8 b + 256 m, row
// the t-th of 2 (i % 4), 2 (i % 4) + 1, 2 (i % 4 + 4), 2 (i % 4 + 4) + 1.
FERRY_HOST_DEVICE int weight_perm(int j) {
  const int b8 = j & 7;
  const int idx = (j & ~7) | (b8 < 4 ? 2 * b8 : 2 * b8 - 7);  // interleave [0, 2, 4, 6, 1, 3, 5, 7]
  const int i = idx >> 5, m = (idx >> 3) & 3, b = (idx >> 2) & 1, t = idx & 3;
  const int row = t < 2 ? 2 * (i & 3) + t : 2 * ((i & 3) + 4) + (t - 2);
  return 16 * row + (i >> 2) + 8 * b + 256 * m;
}

// Element v of a 1024-element chunk (16 inputs x 64 outputs, as four 16 x 16 tiles): its output
// n and input k within the chunk. Nibble q of word c of row r of the repacked weight is element
// weight_perm((8 c + q) % 1024) of the chunk of outputs [64 (8 c / 1024), +64) and inputs
// [16 r, 16 r + 16).
FERRY_HOST_DEVICE void chunk_element(int v, int& n, int& k) {
  n = (v >> 8) * static_cast<int>(kTile) + (v & 15);
  k = (v >> 4) & 15;
}

// The output n and the input kk (within the word's 16) of nibble p % 8 of word p / 8 in a row of
// words, given v = weight_perm(p % 1024).
FERRY_HOST_DEVICE void word_element(int64_t p, int v, int64_t& n, int& kk) {
  int nl;
  chunk_element(v, nl, kk);
  n = p / kPermChunk * kChunkN + nl;
}

// Where the scale of group g of output n lies in the permuted [groups, n_total] scales.
FERRY_HOST_DEVICE int64_t scale_index(int64_t g, int64_t n, int64_t groups, int64_t n_total) {
  if (groups > 1) {
    const int64_t w = n & 63;  // scale_perm[8 i + j] = i + 8 j
    return g * n_total + (n & ~int64_t{63}) + 8 * (w & 7) + (w >> 3);
  }
  const int64_t w = n & 31;  // scale_perm_single[8 i + t] = 2 i + [0, 1, 8, 9, 16, 17, 24, 25][t]
  return (n & ~int64_t{31}) + 8 * ((w & 7) >> 1) + 2 * (w >> 3) + (w & 1);
}

}  // namespace ferry::kernels::marlin

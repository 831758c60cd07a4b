// The delta compare's wide kernels (delta_scan.cc's only includer): 32 bytes a side with AVX2, 64
// with AVX-512 BW and VBMI2, each compiled for its instruction set by target attributes and chosen at
// run time (delta_scan.h, ScanKind). Internal to the data plane.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry::dataplane::detail {

// Both wide compares close the changed values up without a branch per element: a vector with
// changes stores a whole vector of values at `v` and moves `v` past the changed ones only. `v` never runs
// ahead of the elements scanned (at most one value per element), so a vector stored there ends
// within the group's own elements' room: inside `values`, and inside a thread's slice of it.

// For each mask of the changed elements among the first min(8, 16 / E) of 16 bytes, the shuffle
// (pshufb) that closes their bytes up in order; lanes past them read zero.
template <size_t E>
struct CloseUp {
  static constexpr size_t kElements = 16 / E < 8 ? 16 / E : 8;
  alignas(16) uint8_t shuffle[size_t{1} << kElements][16];
  constexpr CloseUp() : shuffle() {
    for (size_t m = 0; m < (size_t{1} << kElements); ++m) {
      size_t k = 0;
      for (size_t j = 0; j < kElements; ++j) {
        if ((m >> j & 1) == 0) continue;
        for (size_t i = 0; i < E; ++i) shuffle[m][k++] = static_cast<uint8_t>(j * E + i);
      }
      while (k < 16) shuffle[m][k++] = 0x80;
    }
  }
};
template <size_t E>
constexpr CloseUp<E> kCloseUp{};

// The changed ones among the first CloseUp<E>::kElements elements of `x`, marked in `m`, stored
// closed up at `v`, `v` moved past them. As many bytes are written as those elements take (8 for
// 1-byte elements, else 16): never past their own room.
template <size_t E>
__attribute__((target("avx2,popcnt"))) inline void close_up(__m128i x, unsigned m, uint8_t*& v) {
  const __m128i s = _mm_load_si128(reinterpret_cast<const __m128i*>(kCloseUp<E>.shuffle[m]));
  if constexpr (E == 1) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(v), _mm_shuffle_epi8(x, s));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v), _mm_shuffle_epi8(x, s));
  }
  v += static_cast<size_t>(__builtin_popcount(m)) * E;
}

// A block of vectors is scanned one of two ways, chosen by the block before's rate of change (`rare`,
// carried from call to call by a caller that scans a run in several, tensor_scan.h): while
// changes are rare, a vector with none is passed by a branch (a compare and the bitmap's store);
// past one element in 64, when that branch would mispredict more than the stores it saves cost,
// every vector closes its values up without one.
constexpr size_t kScanBlock = 4096;  // elements
inline bool rare_changes(size_t changed, size_t elements) { return changed * 64 < elements; }

// One vector of 32 bytes a side (AVX2) at element e; the values closed up by byte shuffles.
template <size_t E, bool Xor, bool PassUnchanged>
__attribute__((target("avx2,popcnt"))) inline void avx2_vector(const uint8_t* before, const uint8_t* after, size_t e,
                                                               uint8_t* bitmap, uint8_t*& v) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(before + e * E));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(after + e * E));
  const __m256i x = Xor ? _mm256_xor_si256(a, b) : b;
  const __m128i lo = _mm256_castsi256_si128(x), hi = _mm256_extracti128_si256(x, 1);
  if constexpr (E == 1) {
    const uint32_t m = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a, b)));
    std::memcpy(bitmap + e / 8, &m, 4);
    if (PassUnchanged && m == 0) return;
    close_up<1>(lo, m & 0xff, v);
    close_up<1>(_mm_srli_si128(lo, 8), m >> 8 & 0xff, v);
    close_up<1>(hi, m >> 16 & 0xff, v);
    close_up<1>(_mm_srli_si128(hi, 8), m >> 24, v);
  } else if constexpr (E == 2) {
    // The compare's 16-bit lanes packed to bytes within each 128-bit half: bits 0-7 and 16-23.
    const __m256i eq = _mm256_cmpeq_epi16(a, b);
    const uint32_t m = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_packs_epi16(eq, eq)));
    bitmap[e / 8] = static_cast<uint8_t>(m);
    bitmap[e / 8 + 1] = static_cast<uint8_t>(m >> 16);
    if (PassUnchanged && (m & 0xff00ff) == 0) return;
    close_up<2>(lo, m & 0xff, v);
    close_up<2>(hi, m >> 16 & 0xff, v);
  } else {
    static_assert(E == 4);
    const unsigned m = ~static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)))) & 0xff;
    bitmap[e / 8] = static_cast<uint8_t>(m);
    if (PassUnchanged && m == 0) return;
    close_up<4>(lo, m & 0xf, v);
    close_up<4>(hi, m >> 4, v);
  }
}

// 32 bytes of each side per compare (AVX2). Returns the elements scanned, a multiple of 32 / E (the
// caller scans the rest).
template <size_t E, bool Xor>
__attribute__((target("avx2,popcnt"))) size_t scan_avx2(const uint8_t* before, const uint8_t* after, size_t n,
                                                        uint8_t* bitmap, uint8_t*& v, bool& rare) {
  constexpr size_t kWidth = 32 / E;
  size_t e = 0;
  while (e + kWidth <= n) {
    const size_t stop = e + std::min(kScanBlock, (n - e) / kWidth * kWidth);
    const uint8_t* const v0 = v;
    const size_t start = e;
    if (rare) {
      for (; e < stop; e += kWidth) avx2_vector<E, Xor, true>(before, after, e, bitmap, v);
    } else {
      for (; e < stop; e += kWidth) avx2_vector<E, Xor, false>(before, after, e, bitmap, v);
    }
    rare = rare_changes(static_cast<size_t>(v - v0) / E, e - start);
  }
  return e;
}

// One vector of 64 bytes a side (AVX-512BW) at element e: the mask of the elements that differ is
// their bitmap bits as they are (element j of the vector as bit j, little-endian), and the values
// close up in one compress (VBMI2).
template <size_t E, bool Xor, bool PassUnchanged>
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) inline void avx512_vector(const uint8_t* before,
                                                                                         const uint8_t* after, size_t e,
                                                                                         uint8_t* bitmap, uint8_t*& v) {
  const __m512i a = _mm512_loadu_si512(before + e * E);
  const __m512i b = _mm512_loadu_si512(after + e * E);
  const __m512i x = Xor ? _mm512_xor_si512(a, b) : b;
  uint64_t m;
  if constexpr (E == 1) {
    m = _mm512_cmpneq_epi8_mask(a, b);
  } else if constexpr (E == 2) {
    m = _mm512_cmpneq_epi16_mask(a, b);
  } else {
    static_assert(E == 4);
    m = _mm512_cmpneq_epi32_mask(a, b);
  }
  std::memcpy(bitmap + e / 8, &m, 64 / E / 8);
  if (PassUnchanged && m == 0) return;
  __m512i c;
  if constexpr (E == 1) {
    c = _mm512_maskz_compress_epi8(m, x);
  } else if constexpr (E == 2) {
    c = _mm512_maskz_compress_epi16(static_cast<__mmask32>(m), x);
  } else {
    c = _mm512_maskz_compress_epi32(static_cast<__mmask16>(m), x);
  }
  _mm512_storeu_si512(v, c);
  v += static_cast<size_t>(__builtin_popcountll(m)) * E;
}

// 64 bytes of each side per compare (AVX-512). Returns the elements scanned, a multiple of 64 / E.
// (scan_avx2's block loop again: each loop is compiled for its own instruction set, so that its
// vector function inlines; one loop shared by both would be compiled for neither.)
template <size_t E, bool Xor>
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) size_t scan_avx512(const uint8_t* before,
                                                                                  const uint8_t* after, size_t n,
                                                                                  uint8_t* bitmap, uint8_t*& v,
                                                                                  bool& rare) {
  constexpr size_t kWidth = 64 / E;
  size_t e = 0;
  while (e + kWidth <= n) {
    const size_t stop = e + std::min(kScanBlock, (n - e) / kWidth * kWidth);
    const uint8_t* const v0 = v;
    const size_t start = e;
    if (rare) {
      for (; e < stop; e += kWidth) avx512_vector<E, Xor, true>(before, after, e, bitmap, v);
    } else {
      for (; e < stop; e += kWidth) avx512_vector<E, Xor, false>(before, after, e, bitmap, v);
    }
    rare = rare_changes(static_cast<size_t>(v - v0) / E, e - start);
  }
  return e;
}

}  // namespace ferry::dataplane::detail
#endif

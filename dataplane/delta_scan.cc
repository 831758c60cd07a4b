// The delta codec's scans (delta_scan.h).
#include "dataplane/delta_scan.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/work_pool.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FERRY_WIDE_SCAN 1
#include "dataplane/delta_scan_wide.h"
#endif

namespace ferry::dataplane::detail {
namespace {

#if FERRY_WIDE_SCAN
// The fastest compare this CPU runs (__builtin_cpu_init first: this runs as a static initializer,
// perhaps before the compiler's own).
ScanKind best_scan() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) {
    return ScanKind::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) return ScanKind::kAvx2;
  return ScanKind::kNarrow;
}
const ScanKind kBestScan = best_scan();
#else
constexpr ScanKind kBestScan = ScanKind::kNarrow;
#endif
std::atomic<ScanKind> scan_in_use{kBestScan};

// The bits of 8 elements of E bytes at `a` and `b` that differ, element j as bit j: one bitmap
// byte. With SSE2 (every x86-64) a vector compare per 16 bytes; elsewhere element by element.
template <size_t E>
inline uint8_t changed8(const uint8_t* a, const uint8_t* b) {
#if defined(__SSE2__)
  if constexpr (E == 1) {
    const __m128i eq = _mm_cmpeq_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    return static_cast<uint8_t>(~_mm_movemask_epi8(eq));
  } else if constexpr (E == 2) {
    const __m128i eq = _mm_cmpeq_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    return static_cast<uint8_t>(~_mm_movemask_epi8(_mm_packs_epi16(eq, eq)));
  } else if constexpr (E == 4) {
    const auto lo = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)),
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const auto hi = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16)),
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
    const __m128i eq = _mm_packs_epi32(lo, hi);  // all ones or zero per lane: no saturation
    return static_cast<uint8_t>(~_mm_movemask_epi8(_mm_packs_epi16(eq, eq)));
  }
#endif
  uint8_t m = 0;
  for (size_t j = 0; j < 8; ++j) m |= static_cast<uint8_t>((std::memcmp(a + j * E, b + j * E, E) != 0) << j);
  return m;
}

// Scans n elements of E bytes (runtime `elem` when E is 0): the changed ones' bits into `bitmap`
// (element i as bit i % 8 of byte i / 8; bits past n clear) and their new values, in order, to
// `values`. Returns how many changed. A group of 8 elements that did not change (most of them
// between two RL steps) costs one compare and one store.
// With Xor, the values are new XOR old.
template <size_t E, bool Xor>
uint64_t scan_changes(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, uint8_t* bitmap,
                      uint8_t* values, bool& rare) {
  const size_t width = E != 0 ? E : elem;
  uint8_t* v = values;
  size_t e = 0;
  if constexpr (E != 0) {
#if FERRY_WIDE_SCAN
    switch (scan_in_use.load(std::memory_order_relaxed)) {
      case ScanKind::kAvx512: e = scan_avx512<E, Xor>(before, after, n, bitmap, v, rare); break;
      case ScanKind::kAvx2: e = scan_avx2<E, Xor>(before, after, n, bitmap, v, rare); break;
      case ScanKind::kNarrow: break;
    }
#endif
    for (; e + 8 <= n; e += 8) {
      uint8_t m = changed8<E>(before + e * E, after + e * E);
      bitmap[e / 8] = m;
      for (; m != 0; m &= static_cast<uint8_t>(m - 1)) {
        const size_t at = (e + static_cast<size_t>(__builtin_ctz(m))) * E;
        std::memcpy(v, after + at, E);
        if constexpr (Xor) {
          for (size_t i = 0; i < E; ++i) v[i] ^= before[at + i];
        }
        v += E;
      }
    }
  }
  for (; e < n; e += 8) {
    uint8_t m = 0;
    for (size_t j = 0; j < 8 && e + j < n; ++j) {
      const uint8_t* a = after + (e + j) * width;
      if (std::memcmp(before + (e + j) * width, a, width) == 0) continue;
      m |= static_cast<uint8_t>(1u << j);
      std::memcpy(v, a, width);
      if constexpr (Xor) {
        for (size_t i = 0; i < width; ++i) v[i] ^= before[(e + j) * width + i];
      }
      v += width;
    }
    bitmap[e / 8] = m;
  }
  return static_cast<uint64_t>(v - values) / width;
}

template <bool Xor>
uint64_t scan_width(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, uint8_t* bitmap,
                    uint8_t* values, bool& rare) {
  switch (elem) {
    case 1: return scan_changes<1, Xor>(before, after, n, elem, bitmap, values, rare);
    case 2: return scan_changes<2, Xor>(before, after, n, elem, bitmap, values, rare);
    case 4: return scan_changes<4, Xor>(before, after, n, elem, bitmap, values, rare);
    default: return scan_changes<0, Xor>(before, after, n, elem, bitmap, values, rare);
  }
}

// A slice of a compare or of a bitmap's runs, at least: about 40 us of one core's compare, several
// times what handing it to the work pool costs.
constexpr size_t kSliceElements = size_t{1} << 17;
// The most slices a compare or its runs take: a sender's compare is the delta update's largest
// share of work, and up to 16 cores (FERRY_THREADS) take it.
constexpr size_t kMaxScanSlices = 16;

// The runs of set bits of a bitmap of n bits (padded with clear bits to whole 64-bit words),
// [first, first + length) in order: `visit(first, length)` for each, until it returns false.
// A word at a time: its runs' first bits (set, the bit before clear) and last bits (set, the bit
// after clear; the next word's first bit decides for bit 63) are paired in order, a run that is
// still open at the end of a word closing at the first last bit of a later one.
template <typename Visit>
void for_each_run(const uint8_t* bitmap, size_t n, Visit visit) {
  const size_t words = (n + 63) / 64;
  const auto word = [bitmap](size_t w) {
    uint64_t x;
    std::memcpy(&x, bitmap + w * 8, 8);
    return x;
  };
  uint64_t first = 0, carry = 0;  // carry: the previous word's bit 63
  bool open = false;
  uint64_t x = words > 0 ? word(0) : 0;
  for (size_t w = 0; w < words; ++w) {
    const uint64_t next = w + 1 < words ? word(w + 1) : 0;
    if (x != 0) {
      uint64_t starts = x & ~((x << 1) | carry);
      uint64_t lasts = x & ~((x >> 1) | (next << 63));
      const uint64_t at = static_cast<uint64_t>(w) * 64;
      for (; lasts != 0; lasts &= lasts - 1) {
        if (!open) {
          first = at + static_cast<uint64_t>(__builtin_ctzll(starts));
          starts &= starts - 1;
        }
        open = false;
        const uint64_t end = at + static_cast<uint64_t>(__builtin_ctzll(lasts)) + 1;
        if (!visit(first, std::min<uint64_t>(end, n) - first)) return;
      }
      if (starts != 0) {  // a run going on into the next word
        first = at + static_cast<uint64_t>(__builtin_ctzll(starts));
        open = true;
      }
    }
    carry = x >> 63;
    x = next;
  }
}

}  // namespace

uint64_t scan_serial(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                     uint8_t* bitmap, uint8_t* values, bool& rare) {
  return xor_values ? scan_width<true>(before, after, n, elem, bitmap, values, rare)
                    : scan_width<false>(before, after, n, elem, bitmap, values, rare);
}

std::vector<ScanKind> scans_available() {
  std::vector<ScanKind> kinds;
  if (kBestScan == ScanKind::kAvx512) kinds.push_back(ScanKind::kAvx512);
  if (kBestScan != ScanKind::kNarrow) kinds.push_back(ScanKind::kAvx2);
  kinds.push_back(ScanKind::kNarrow);
  return kinds;
}

ScanKind use_scan(ScanKind kind) {
  // None this CPU lacks: the narrower ones are its too.
  return scan_in_use.exchange(std::min(kind, kBestScan));
}

const char* scan_name(ScanKind kind) {
  switch (kind) {
    case ScanKind::kAvx512: return "64 bytes per compare (AVX-512)";
    case ScanKind::kAvx2: return "32 bytes per compare (AVX2)";
    case ScanKind::kNarrow: return "16 bytes per compare";
  }
  return "unknown";
}

// Slices of at least kSliceElements, at most host_threads() (FERRY_THREADS) and kMaxScanSlices, each
// a multiple of 8 elements so that each writes bitmap bytes of its own; the values of every slice are then closed
// up in order.
uint64_t scan_parallel(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                       uint8_t* bitmap, uint8_t* values) {
  const size_t slices = slices_for(n, kSliceElements, kMaxScanSlices);
  if (slices < 2) {
    bool rare = true;
    return scan_serial(before, after, n, elem, xor_values, bitmap, values, rare);
  }
  const size_t step = (n / slices) & ~size_t{7};
  std::vector<uint64_t> counts(slices, 0);
  run_pieces(slices, [&](size_t t) {
    const size_t lo = t * step, hi = t + 1 == slices ? n : (t + 1) * step;
    bool rare = true;
    counts[t] = scan_serial(before + lo * elem, after + lo * elem, hi - lo, elem, xor_values, bitmap + lo / 8,
                            values + lo * elem, rare);
  });
  uint64_t k = counts[0];
  for (size_t t = 1; t < slices; ++t) {
    std::memmove(values + k * elem, values + t * step * elem, counts[t] * elem);
    k += counts[t];
  }
  return k;
}

RunsSlice slice_runs(const uint8_t* bitmap, size_t lo, size_t hi, size_t limit, uint8_t* pairs) {
  // Kept in locals while the pairs are written (a byte store may alias any field of a slice).
  RunsSlice S;
  uint8_t* w = pairs;
  uint64_t at = 0;
  for_each_run(bitmap + lo / 8, hi - lo, [&](uint64_t first_in, uint64_t len) {
    const uint64_t first = lo + first_in, end = first + len;
    if (S.count == 0) {
      S.first_start = first;
      S.first_end = end;
    } else {
      S.last_at = static_cast<size_t>(w - pairs);
      S.before_last_end = at;
      w = put_varint(put_varint(w, first - at), len);
    }
    S.last_start = first;
    S.last_end = at = end;
    ++S.count;
    S.over = static_cast<size_t>(w - pairs) > limit;
    return !S.over;
  });
  S.bytes = static_cast<size_t>(w - pairs);
  return S;
}

std::optional<std::pair<uint64_t, size_t>> join_runs(const RunsSlice* slices, const uint8_t* const* pairs, size_t count,
                                                     size_t limit, uint8_t* runs) {
  uint8_t* w = runs;
  uint64_t r = 0, at = 0, start = 0, end = 0;
  bool pending = false;
  const auto put_pending = [&] {
    w = put_varint(put_varint(w, start - at), end - start);
    at = end;
    ++r;
    return static_cast<size_t>(w - runs) <= limit;
  };
  for (size_t t = 0; t < count; ++t) {
    const RunsSlice& S = slices[t];
    if (S.over) return std::nullopt;
    if (S.count == 0) continue;
    if (pending && end == S.first_start) {
      end = S.first_end;  // one run across the border
    } else {
      if (pending && !put_pending()) return std::nullopt;
      start = S.first_start;
      end = S.first_end;
      pending = true;
    }
    if (S.count < 2) continue;
    if (!put_pending() || static_cast<size_t>(w - runs) + S.last_at > limit) return std::nullopt;
    std::memcpy(w, pairs[t], S.last_at);
    w += S.last_at;
    at = S.before_last_end;
    r += S.count - 2;
    start = S.last_start;
    end = S.last_end;
  }
  if (pending && !put_pending()) return std::nullopt;
  return std::pair<uint64_t, size_t>{r, static_cast<size_t>(w - runs)};
}

std::optional<std::pair<uint64_t, size_t>> runs_of(const uint8_t* bitmap, size_t n, size_t limit, uint8_t* runs) {
  const size_t slices = slices_for(n, kSliceElements, kMaxScanSlices);
  if (slices < 2) {
    uint8_t* w = runs;
    uint64_t r = 0, at = 0;
    bool fits = true;
    for_each_run(bitmap, n, [&](uint64_t first, uint64_t len) {
      w = put_varint(put_varint(w, first - at), len);
      at = first + len;
      ++r;
      return fits = static_cast<size_t>(w - runs) <= limit;
    });
    if (!fits) return std::nullopt;
    return std::pair<uint64_t, size_t>{r, static_cast<size_t>(w - runs)};
  }
  // The calling thread's, taken here (a lambda run on another thread would name that thread's own,
  // and an allocation failing there would end the process), and given back past 64 MiB on any exit.
  thread_local std::vector<Scratch> memory_of_this_thread(kMaxScanSlices);
  std::vector<Scratch>& memory = memory_of_this_thread;
  struct TrimAll {
    std::vector<Scratch>& m;
    ~TrimAll() {
      for (Scratch& s : m) s.trim();
    }
  } const trim{memory};
  std::vector<const uint8_t*> bases(slices);
  const size_t step = (n / slices) & ~size_t{63};
  // (A slice's pairs take no more bytes than its elements: a varint is never longer than its value.)
  for (size_t t = 0; t < slices; ++t) {
    bases[t] = memory[t].get(std::min(limit, (t + 1 == slices ? n : (t + 1) * step) - t * step) + kRunsSlack);
  }
  std::vector<RunsSlice> sl(slices);
  run_pieces(slices, [&](size_t t) {
    const size_t lo = t * step, hi = t + 1 == slices ? n : (t + 1) * step;
    sl[t] = slice_runs(bitmap, lo, hi, limit, memory[t].data());
  });
  return join_runs(sl.data(), bases.data(), slices, limit, runs);
}

// Eight bytes at a time while a word cannot hold more ends than remain.
const uint8_t* past_varints(const uint8_t* p, const uint8_t* end, uint64_t count) {
  for (; count >= 8 && end - p >= 8; p += 8) {
    uint64_t x;
    std::memcpy(&x, p, 8);
    count -= (((~x & 0x8080808080808080ull) >> 7) * 0x0101010101010101ull) >> 56;
  }
  for (; count > 0 && p < end; ++p) count -= *p < 0x80 ? 1 : 0;
  return count == 0 ? p : nullptr;
}

// The chunks' borders in one pass that counts the ends of varints, a word at a time; each chunk's
// pairs then decoded and checked on a thread of its own, with their elements and values summed;
// the sums put in order last.
std::optional<RunsSplit> split_runs(const uint8_t* pairs, const uint8_t* end, uint64_t r, size_t n, size_t elem) {
  constexpr uint64_t kPairs = uint64_t{1} << 15;  // a chunk's pairs, at least
  const size_t count = std::min(slices_for(static_cast<size_t>(r), kPairs), kMaxRunsChunks);
  if (count < 2 || elem == 0) return std::nullopt;
  RunsSplit split;
  split.chunks.resize(count);
  const uint8_t* p = pairs;
  for (size_t t = 0; t < count; ++t) {
    RunsChunk& c = split.chunks[t];
    c.pairs = r / count + (t < r % count ? 1 : 0);
    c.begin = p;
    if ((p = past_varints(p, end, 2 * c.pairs)) == nullptr) return std::nullopt;
    c.end = p;
    c.index = t;
    c.alone = false;
  }
  struct Sums {
    uint64_t elements = 0, values = 0;
    bool good = false;
  };
  std::vector<Sums> sums(count);
  run_pieces(count, [&](size_t t) {
    const RunsChunk& c = split.chunks[t];
    const uint8_t* q = c.begin;
    uint64_t at = 0, k = 0;
    for (uint64_t i = 0; i < c.pairs; ++i) {
      uint64_t skip = 0, len = 0;
      if (!get_varint(&q, c.end, &skip) || !get_varint(&q, c.end, &len)) return;
      if (len == 0 || skip > n - at || len > n - at - skip) return;
      at += skip + len;
      k += len;
    }
    sums[t] = Sums{at, k, q == c.end};
  });
  uint64_t at = 0, k = 0;
  for (size_t t = 0; t < count; ++t) {
    RunsChunk& c = split.chunks[t];
    if (!sums[t].good || sums[t].elements > n - at) return std::nullopt;
    c.at = at;
    c.value = k;
    at += sums[t].elements;
    k += sums[t].values;
    c.stop = at;
  }
  const auto value_bytes = static_cast<size_t>(end - p);
  if (value_bytes % elem != 0 || value_bytes / elem != k) return std::nullopt;
  split.values = p;
  split.changed = k;
  return split;
}

}  // namespace ferry::dataplane::detail

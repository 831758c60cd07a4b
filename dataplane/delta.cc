#include "dataplane/delta.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <zstd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ferry::dataplane {
namespace {

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Reads one varint of at most 10 bytes from [*p, end); false when it runs off the end or is longer.
bool get_varint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  uint64_t x = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    const uint8_t b = *(*p)++;
    x |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *v = x;
      return true;
    }
  }
  return false;
}

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
                      uint8_t* values) {
  const size_t width = E != 0 ? E : elem;
  uint8_t* v = values;
  size_t e = 0;
  if constexpr (E != 0) {
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
                    uint8_t* values) {
  switch (elem) {
    case 1: return scan_changes<1, Xor>(before, after, n, elem, bitmap, values);
    case 2: return scan_changes<2, Xor>(before, after, n, elem, bitmap, values);
    case 4: return scan_changes<4, Xor>(before, after, n, elem, bitmap, values);
    default: return scan_changes<0, Xor>(before, after, n, elem, bitmap, values);
  }
}

uint64_t scan_any(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values, uint8_t* bitmap,
                  uint8_t* values) {
  return xor_values ? scan_width<true>(before, after, n, elem, bitmap, values)
                    : scan_width<false>(before, after, n, elem, bitmap, values);
}

// fn(t) for t in [0, count), each on a thread of its own (on the caller's when none is to be had).
template <typename Fn>
void on_threads(size_t count, Fn&& fn) {
  std::vector<std::jthread> threads;
  threads.reserve(count);
  for (size_t t = 0; t < count; ++t) {
    try {
      threads.emplace_back([&fn, t] { fn(t); });
    } catch (const std::system_error&) {
      fn(t);
    }
  }
}

// How many slices of at least 1 Mi elements a large piece is cut into: at most the hardware's
// threads, 8 at most.
size_t slices_for(size_t n) {
  constexpr size_t kSlice = size_t{1} << 20;
  const size_t hw = std::max<size_t>(std::thread::hardware_concurrency(), 1);
  return std::min({hw, size_t{8}, n / kSlice});
}

// scan_any() over several threads for a large piece: each scans a slice (a multiple of 8
// elements, so each writes bitmap bytes of its own) with its values at the slice's own offset of
// `values`, then the values are closed up in order. One slice per Mi elements, at most the
// hardware's threads (8 at most).
uint64_t scan_parallel(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool xor_values,
                       uint8_t* bitmap, uint8_t* values) {
  const size_t slices = slices_for(n);
  if (slices < 2) return scan_any(before, after, n, elem, xor_values, bitmap, values);
  const size_t step = (n / slices) & ~size_t{7};
  std::vector<uint64_t> counts(slices, 0);
  on_threads(slices, [&](size_t t) {
    const size_t lo = t * step, hi = t + 1 == slices ? n : (t + 1) * step;
    counts[t] =
        scan_any(before + lo * elem, after + lo * elem, hi - lo, elem, xor_values, bitmap + lo / 8, values + lo * elem);
  });
  uint64_t k = counts[0];
  for (size_t t = 1; t < slices; ++t) {
    std::memmove(values + k * elem, values + t * step * elem, counts[t] * elem);
    k += counts[t];
  }
  return k;
}

// The runs of set bits of a bitmap of n bits (padded with clear bits to whole 64-bit words),
// [first, first + length) in order: `visit(first, length)` for each, until it returns false.
template <typename Visit>
void for_each_run(const uint8_t* bitmap, size_t n, Visit visit) {
  const size_t words = (n + 63) / 64;
  const auto word = [bitmap](size_t w) {
    uint64_t x;
    std::memcpy(&x, bitmap + w * 8, 8);
    return x;
  };
  size_t e = 0;
  while (e < n) {
    // The next set bit at or after e.
    size_t w = e / 64;
    uint64_t x = word(w) & (~uint64_t{0} << (e % 64));
    while (x == 0 && ++w < words) x = word(w);
    if (x == 0) return;
    const size_t first = w * 64 + static_cast<size_t>(__builtin_ctzll(x));
    // The next clear bit after it (bits past n are clear); n when every bit to the end is set.
    uint64_t y = ~word(w) & (~uint64_t{0} << (first % 64));
    while (y == 0 && ++w < words) y = ~word(w);
    const size_t end = y == 0 ? n : std::min(n, w * 64 + static_cast<size_t>(__builtin_ctzll(y)));
    if (!visit(static_cast<uint64_t>(first), static_cast<uint64_t>(end - first))) return;
    e = end;
  }
}

Status bad(std::string_view what) { return Status::data_loss(fmt::format("delta piece: {}", what)); }

// A bitmap encoding's header checked: the bitmap of n elements is there, marks none past n, and as
// many values follow as it marks. Returns that many.
Result<uint64_t> check_bitmap(const uint8_t* enc, size_t bytes, size_t n, size_t elem) {
  const size_t map = (n + 7) / 8;
  if (bytes < map) return bad(fmt::format("bitmap of {} elements in {} bytes", n, bytes));
  uint64_t k = 0;
  size_t i = 0;
  for (; i + 8 <= map; i += 8) {
    uint64_t x;
    std::memcpy(&x, enc + i, 8);
    // The bits of a word, counted in registers (the x86-64 baseline has no popcnt instruction).
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    k += (x * 0x0101010101010101ull) >> 56;
  }
  for (; i < map; ++i) k += static_cast<uint64_t>(__builtin_popcount(enc[i]));
  if (n % 8 != 0 && (enc[map - 1] >> (n % 8)) != 0) return bad("bitmap marks elements past the piece");
  if ((bytes - map) / elem != k || (bytes - map) % elem != 0) {
    return bad(fmt::format("bitmap marks {} elements, {} bytes of values follow", k, bytes - map));
  }
  return k;
}

// Walks an encoding's changed elements without trusting it: `visit(element, value)` for each, in
// order, only after the whole encoding was checked (so a bad one writes nothing).
template <typename Visit>
Result<uint64_t> walk(DeltaEncoding encoding, const uint8_t* enc, size_t bytes, size_t n, size_t elem, Visit visit) {
  if (elem == 0) return bad("elements of 0 bytes");
  const uint8_t* end = enc + bytes;
  if (encoding == DeltaEncoding::kBitmap) {
    const size_t map = (n + 7) / 8;
    FERRY_ASSIGN_OR_RETURN(const uint64_t k, check_bitmap(enc, bytes, n, elem));
    const uint8_t* v = enc + map;
    for (size_t i = 0; i < map; ++i) {
      for (uint8_t b = enc[i]; b != 0; b &= static_cast<uint8_t>(b - 1)) {
        visit(i * 8 + static_cast<size_t>(__builtin_ctz(b)), v);
        v += elem;
      }
    }
    return k;
  }
  if (encoding != DeltaEncoding::kRuns) return bad(fmt::format("unknown encoding {}", static_cast<uint32_t>(encoding)));
  // Two passes over the runs: every one checked first, then visited; nothing is allocated for them.
  const uint8_t* p = enc;
  uint64_t r = 0;
  if (!get_varint(&p, end, &r)) return bad("runs: no count");
  if (r > bytes / 2) return bad(fmt::format("{} runs in {} bytes", r, bytes));
  const uint8_t* first_run = p;
  uint64_t at = 0, k = 0;
  for (uint64_t i = 0; i < r; ++i) {
    uint64_t skip = 0, len = 0;
    if (!get_varint(&p, end, &skip) || !get_varint(&p, end, &len)) return bad("runs: truncated");
    if (len == 0 || skip > n - at || len > n - at - skip) {
      return bad(fmt::format("run of {} elements after {} at element {} of {}", len, skip, at, n));
    }
    at += skip + len;
    k += len;
  }
  const size_t values = static_cast<size_t>(end - p);
  if (values % elem != 0 || values / elem != k) {
    return bad(fmt::format("runs cover {} elements, {} bytes of values follow", k, values));
  }
  const uint8_t* v = p;
  p = first_run;
  at = 0;
  for (uint64_t i = 0; i < r; ++i) {
    uint64_t skip = 0, len = 0;
    get_varint(&p, end, &skip);
    get_varint(&p, end, &len);
    at += skip;
    for (uint64_t e = 0; e < len; ++e, v += elem) visit(static_cast<size_t>(at + e), v);
    at += len;
  }
  return k;
}

// Memory a thread reuses from piece to piece, left uninitialised (only what is written is read),
// and given back when a large piece grew it past 64 MiB.
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      data_.reset(new uint8_t[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }
  void trim() {
    if (size_ > (size_t{64} << 20)) data_.reset(), size_ = 0;
  }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

uint8_t* put_varint(uint8_t* w, uint64_t v) {
  while (v >= 0x80) *w++ = static_cast<uint8_t>(v | 0x80), v >>= 7;
  *w++ = static_cast<uint8_t>(v);
  return w;
}

// Room for the bitmap of n elements, padded with clear bits to whole 64-bit words (for_each_run).
uint8_t* scan_bitmap(Scratch& memory, size_t n) {
  uint8_t* bitmap = memory.get((n + 63) / 64 * 8 + 16);
  std::memset(bitmap + (n + 7) / 8 / 8 * 8, 0, 16);
  return bitmap;
}

// Room past a runs limit: a run's pair (20 bytes at most) may be written past it before the limit is
// checked.
constexpr size_t kRunsSlack = 64;

// The runs of the n bits of `bitmap` (padded with clear bits to whole 64-bit words) as varint pairs
// (skip, length) into `runs` (room for limit + kRunsSlack bytes): their count and the bytes written,
// or nullopt once those pass `limit`. A large bitmap is cut into slices of whole words, each
// encoded on a thread of its own: a slice's first run is kept apart (its skip depends on where the
// slice before ended, and a run across the border is one run), as is its last (the next slice's
// first may continue it); the pairs between go as they are.
std::optional<std::pair<uint64_t, size_t>> runs_of(const uint8_t* bitmap, size_t n, size_t limit, uint8_t* runs) {
  const size_t slices = slices_for(n);
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
  struct Slice {
    uint64_t count = 0;
    uint64_t first_start = 0, first_end = 0, last_start = 0, last_end = 0, before_last_end = 0;
    size_t last_at = 0;  // where the last run's pair starts in the slice's pairs (those of runs 2, 3, ...)
    size_t bytes = 0;
    bool over = false;
  };
  // The calling thread's, taken here (a lambda run on another thread would name that thread's own,
  // and an allocation failing there would end the process), and given back past 64 MiB on any exit.
  thread_local std::vector<Scratch> memory_of_this_thread(8);
  std::vector<Scratch>& memory = memory_of_this_thread;
  struct TrimAll {
    std::vector<Scratch>& m;
    ~TrimAll() {
      for (Scratch& s : m) s.trim();
    }
  } const trim{memory};
  std::vector<uint8_t*> bases(slices);
  for (size_t t = 0; t < slices; ++t) bases[t] = memory[t].get(limit + kRunsSlack);
  const size_t step = (n / slices) & ~size_t{63};
  std::vector<Slice> sl(slices);
  on_threads(slices, [&](size_t t) {
    const size_t lo = t * step, hi = t + 1 == slices ? n : (t + 1) * step;
    Slice& S = sl[t];
    uint8_t* const base = bases[t];
    uint8_t* w = base;
    uint64_t at = 0;
    for_each_run(bitmap + lo / 8, hi - lo, [&](uint64_t first_in, uint64_t len) {
      const uint64_t first = lo + first_in, end = first + len;
      if (S.count == 0) {
        S.first_start = first;
        S.first_end = end;
      } else {
        S.last_at = static_cast<size_t>(w - base);
        S.before_last_end = at;
        w = put_varint(put_varint(w, first - at), len);
      }
      S.last_start = first;
      S.last_end = at = end;
      ++S.count;
      S.over = static_cast<size_t>(w - base) > limit;
      return !S.over;
    });
    S.bytes = static_cast<size_t>(w - base);
  });
  uint8_t* w = runs;
  uint64_t r = 0, at = 0, start = 0, end = 0;
  bool pending = false;
  const auto put_pending = [&] {
    w = put_varint(put_varint(w, start - at), end - start);
    at = end;
    ++r;
    return static_cast<size_t>(w - runs) <= limit;
  };
  for (size_t t = 0; t < slices; ++t) {
    const Slice& S = sl[t];
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
    std::memcpy(w, bases[t], S.last_at);
    w += S.last_at;
    at = S.before_last_end;
    r += S.count - 2;
    start = S.last_start;
    end = S.last_end;
  }
  if (pending && !put_pending()) return std::nullopt;
  return std::pair<uint64_t, size_t>{r, static_cast<size_t>(w - runs)};
}

}  // namespace

std::string_view encoding_name(DeltaEncoding encoding) {
  switch (encoding) {
    case DeltaEncoding::kDense:
      return "dense";
    case DeltaEncoding::kBitmap:
      return "bitmap";
    case DeltaEncoding::kRuns:
      return "runs";
  }
  return "unknown";
}

DeltaChoice encode_delta(const uint8_t* before, const uint8_t* after, size_t n, size_t elem, bool prefer_delta,
                         std::vector<uint8_t>& out, bool xor_values) {
  thread_local Scratch bitmap_memory, values_memory;
  // The scan's bitmap, padded with clear bits to whole words, and the changed values (as many as
  // n at most; only what is written is touched).
  uint8_t* bitmap = scan_bitmap(bitmap_memory, n);
  uint8_t* values = values_memory.get(std::max<size_t>(n * elem, 1));
  const uint64_t k = scan_parallel(before, after, n, elem, xor_values, bitmap, values);
  const DeltaChoice choice = encode_scanned(bitmap, values, k, n, elem, prefer_delta, out);
  bitmap_memory.trim();
  values_memory.trim();
  return choice;
}

DeltaChoice encode_scanned(const uint8_t* bitmap, const uint8_t* values, uint64_t k, size_t n, size_t elem,
                           bool prefer_delta, std::vector<uint8_t>& out) {
  out.clear();
  thread_local Scratch runs_memory;
  const size_t map_bytes = (n + 7) / 8;
  // The runs' varints, for as long as they stay smaller than the bitmap (past it, the bitmap wins).
  uint8_t* runs = runs_memory.get(map_bytes + kRunsSlack);
  const auto found = runs_of(bitmap, n, map_bytes, runs);
  const uint64_t r = found ? found->first : 0;
  uint8_t* w = runs + (found ? found->second : 0);
  const size_t value_bytes = static_cast<size_t>(k) * elem;
  const size_t by_bitmap = map_bytes + value_bytes;
  const size_t by_runs = found ? varint_size(r) + found->second + value_bytes : SIZE_MAX;
  DeltaChoice choice{DeltaEncoding::kDense, k};
  if (prefer_delta || std::min(by_bitmap, by_runs) < n * elem) {
    out.resize(std::min(by_runs, by_bitmap));
    uint8_t* o = out.data();
    if (by_runs <= by_bitmap) {
      choice.encoding = DeltaEncoding::kRuns;
      o = put_varint(o, r);
      std::memcpy(o, runs, static_cast<size_t>(w - runs));
      o += w - runs;
    } else {
      choice.encoding = DeltaEncoding::kBitmap;
      std::memcpy(o, bitmap, map_bytes);
      o += map_bytes;
    }
    if (value_bytes != 0) std::memcpy(o, values, value_bytes);
  }
  runs_memory.trim();
  return choice;
}

namespace {

// One zstd context of each kind per thread, made on first use (a context per call would allocate
// its tables every time).
struct ZstdContexts {
  ZSTD_CCtx* c = nullptr;
  ZSTD_DCtx* d = nullptr;
  ~ZstdContexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};
thread_local ZstdContexts zstd_contexts;

// Gives back a thread's scratch past 64 MiB whichever way the scope is left.
struct TrimOnExit {
  Scratch& s;
  ~TrimOnExit() { s.trim(); }
};

}  // namespace

bool compress_delta(std::vector<uint8_t>& encoded, int level) {
  thread_local Scratch frame_memory;
  const TrimOnExit trim{frame_memory};
  if (zstd_contexts.c == nullptr && (zstd_contexts.c = ZSTD_createCCtx()) == nullptr) return false;
  const size_t cap = ZSTD_compressBound(encoded.size());
  uint8_t* frame = frame_memory.get(cap);
  const size_t n = ZSTD_compressCCtx(zstd_contexts.c, frame, cap, encoded.data(), encoded.size(), level);
  if (ZSTD_isError(n) || n > encoded.size() - encoded.size() / 8) return false;
  encoded.assign(frame, frame + n);
  return true;
}

namespace {

// The encoding `field` names and its bytes, a zstd frame inflated into `inflated` first. DataLoss
// for unknown flags, a frame that does not say its size or says more than an encoding of n
// elements can take (a bitmap with every value: the sender's largest), and a frame that does not
// inflate to exactly that.
Result<std::pair<const uint8_t*, size_t>> unpack_field(uint32_t field, const uint8_t* encoded, size_t bytes, size_t n,
                                                       size_t elem, Scratch& inflated) {
  if ((field & ~(0xffu | kDeltaXor | kDeltaZstd)) != 0) return bad(fmt::format("unknown encoding flags {:#x}", field));
  if ((field & kDeltaZstd) == 0) return std::pair{encoded, bytes};
  const unsigned long long size = ZSTD_getFrameContentSize(encoded, bytes);
  const unsigned long long most =
      static_cast<unsigned long long>((n + 7) / 8) + static_cast<unsigned long long>(n) * elem;
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return bad("zstd frame without its size");
  if (size > most) {
    return bad(
        fmt::format("zstd frame of {} bytes for {} elements (an encoding of them takes {} at most)", size, n, most));
  }
  if (zstd_contexts.d == nullptr && (zstd_contexts.d = ZSTD_createDCtx()) == nullptr) {
    return Status::resource_exhausted("zstd: no decompression context");
  }
  uint8_t* out = inflated.get(std::max<size_t>(static_cast<size_t>(size), 1));
  const size_t got = ZSTD_decompressDCtx(zstd_contexts.d, out, static_cast<size_t>(size), encoded, bytes);
  if (ZSTD_isError(got) || got != size) {
    return bad(fmt::format("zstd frame: {}", ZSTD_isError(got) ? ZSTD_getErrorName(got) : "shorter than it says"));
  }
  return std::pair<const uint8_t*, size_t>{out, static_cast<size_t>(size)};
}

}  // namespace

Status delta_bitmap(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem,
                    DeltaBitmap& out) {
  out.built.clear();
  out.inflated.clear();
  out.bitmap = out.values = nullptr;
  out.changed = 0;
  out.xor_values = (field & kDeltaXor) != 0;
  if (elem == 0) return bad("elements of 0 bytes");
  thread_local Scratch inflated;
  const TrimOnExit trim{inflated};
  FERRY_ASSIGN_OR_RETURN(auto bytes, unpack_field(field, encoded, encoded_bytes, n, elem, inflated));
  if ((field & kDeltaZstd) != 0) {  // the thread's scratch is given back: the caller keeps a copy
    out.inflated.assign(bytes.first, bytes.first + bytes.second);
    bytes.first = out.inflated.data();
  }
  const auto encoding = static_cast<DeltaEncoding>(field & 0xff);
  // A bitmap encoding goes as it is, its header checked; a runs encoding is checked whole first (as
  // apply_delta does), then its runs set in a bitmap of its own. The values end either, in order.
  if (encoding == DeltaEncoding::kBitmap) {
    FERRY_ASSIGN_OR_RETURN(out.changed, check_bitmap(bytes.first, bytes.second, n, elem));
    out.bitmap = bytes.first;
  } else {
    if (encoding != DeltaEncoding::kRuns)
      return bad(fmt::format("unknown encoding {}", static_cast<uint32_t>(encoding)));
    // One pass, with walk()'s checks: the bitmap is this call's own until every run was checked.
    out.built.assign((n + 7) / 8, 0);
    uint8_t* map = out.built.data();
    const uint8_t* p = bytes.first;
    const uint8_t* end = bytes.first + bytes.second;
    uint64_t r = 0, at = 0, skip = 0, len = 0;
    if (!get_varint(&p, end, &r)) return bad("runs: no count");
    if (r > bytes.second / 2) return bad(fmt::format("{} runs in {} bytes", r, bytes.second));
    for (uint64_t i = 0; i < r; ++i) {
      if (!get_varint(&p, end, &skip) || !get_varint(&p, end, &len)) return bad("runs: truncated");
      if (len == 0 || skip > n - at || len > n - at - skip) {
        return bad(fmt::format("run of {} elements after {} at element {} of {}", len, skip, at, n));
      }
      out.changed += len;
      at += skip;
      // Bits [at, at + len): the partial bytes at either end bit by bit, the whole ones between at once.
      uint64_t e = at;
      const uint64_t stop = at + len;
      for (; e < stop && e % 8 != 0; ++e) map[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
      if (stop - e >= 8) {
        std::memset(map + e / 8, 0xff, static_cast<size_t>((stop - e) / 8));
        e += (stop - e) / 8 * 8;
      }
      for (; e < stop; ++e) map[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
      at = stop;
    }
    const size_t values = static_cast<size_t>(end - p);
    if (values % elem != 0 || values / elem != out.changed) {
      return bad(fmt::format("runs cover {} elements, {} bytes of values follow", out.changed, values));
    }
    out.bitmap = map;
  }
  out.values = bytes.first + bytes.second - static_cast<size_t>(out.changed) * elem;
  return ok_status();
}

Result<uint64_t> delta_changed(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem) {
  thread_local Scratch inflated;
  const TrimOnExit trim{inflated};
  FERRY_ASSIGN_OR_RETURN(const auto bytes, unpack_field(field, encoded, encoded_bytes, n, elem, inflated));
  return walk(static_cast<DeltaEncoding>(field & 0xff), bytes.first, bytes.second, n, elem,
              [](size_t, const uint8_t*) {});
}

Status apply_delta(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, uint8_t* values, size_t n, size_t elem,
                   std::vector<std::pair<uint64_t, uint64_t>>* changed) {
  thread_local Scratch inflated;
  const TrimOnExit trim{inflated};
  FERRY_ASSIGN_OR_RETURN(const auto bytes, unpack_field(field, encoded, encoded_bytes, n, elem, inflated));
  const auto encoding = static_cast<DeltaEncoding>(field & 0xff);
  const bool xor_values = (field & kDeltaXor) != 0;
  // Checked whole first: a bad encoding leaves the values as they were.
  FERRY_RETURN_IF_ERROR(walk(encoding, bytes.first, bytes.second, n, elem, [](size_t, const uint8_t*) {}).status());
  if (changed != nullptr) changed->clear();
  return walk(encoding, bytes.first, bytes.second, n, elem,
              [&](size_t e, const uint8_t* v) {
                uint8_t* at = values + e * elem;
                if (xor_values) {
                  for (size_t i = 0; i < elem; ++i) at[i] ^= v[i];
                } else {
                  std::memcpy(at, v, elem);
                }
                if (changed == nullptr) return;
                if (!changed->empty() && changed->back().first + changed->back().second == e) {
                  ++changed->back().second;
                } else {
                  changed->emplace_back(e, 1);
                }
              })
      .status();
}

}  // namespace ferry::dataplane

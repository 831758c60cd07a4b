#include "dataplane/delta.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <zstd.h>

#include "core/work_pool.h"
#include "dataplane/delta_scan.h"

namespace ferry::dataplane {
namespace {

using detail::get_varint;
using detail::kRunsSlack;
using detail::put_varint;
using detail::runs_of;
using detail::RunsChunk;
using detail::scan_bitmap;
using detail::scan_parallel;
using detail::Scratch;

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

// A runs encoding's runs, `visit(chunk, first, length, values)` for each in order. With CheckFirst,
// only after every run and the count of values were checked, in a pass of its own (so a bad encoding
// visits nothing); without, during the checking pass, for a caller whose writes are its own until
// the result says the encoding is good. Nothing is allocated for the runs.
// With Threads, a large encoding's runs are checked, then visited, in chunks on several threads at
// once (detail::split_runs), each run with the chunk it is in; any check failing there, the single
// pass below says which. Otherwise every run comes with one chunk that is alone.
template <bool CheckFirst, bool Threads, typename Visit>
Result<uint64_t> walk_runs(const uint8_t* enc, size_t bytes, size_t n, size_t elem, Visit visit) {
  if (elem == 0) return bad("elements of 0 bytes");
  const uint8_t* end = enc + bytes;
  const uint8_t* p = enc;
  uint64_t r = 0;
  if (!get_varint(&p, end, &r)) return bad("runs: no count");
  if (r > bytes / 2) return bad(fmt::format("{} runs in {} bytes", r, bytes));
  if constexpr (Threads) {
    if (auto split = detail::split_runs(p, end, r, n, elem)) {
      std::atomic<bool> no_memory = false;  // a visit's allocation failed on a worker thread
      run_pieces(split->chunks.size(), [&](size_t t) {
        const RunsChunk& c = split->chunks[t];
        const uint8_t* q = c.begin;
        const uint8_t* v = split->values + c.value * elem;
        uint64_t at = c.at;
        try {
          for (uint64_t i = 0; i < c.pairs; ++i) {
            uint64_t skip = 0, len = 0;
            get_varint(&q, c.end, &skip);
            get_varint(&q, c.end, &len);
            at += skip;
            visit(c, at, len, v);
            v += len * elem;
            at += len;
          }
        } catch (const std::bad_alloc&) {
          no_memory = true;
        }
      });
      if (no_memory) return Status::resource_exhausted("delta piece: no memory to note its runs");
      return split->changed;
    }
  }
  const RunsChunk whole{.begin = p, .end = end, .pairs = r, .stop = n};
  const uint8_t* first_run = p;
  uint64_t at = 0, k = 0;
  for (uint64_t i = 0; i < r; ++i) {
    uint64_t skip = 0, len = 0;
    if (!get_varint(&p, end, &skip) || !get_varint(&p, end, &len)) return bad("runs: truncated");
    if (len == 0 || skip > n - at || len > n - at - skip) {
      return bad(fmt::format("run of {} elements after {} at element {} of {}", len, skip, at, n));
    }
    if constexpr (!CheckFirst) visit(whole, at + skip, len, nullptr);
    at += skip + len;
    k += len;
  }
  const size_t values = static_cast<size_t>(end - p);
  if (values % elem != 0 || values / elem != k) {
    return bad(fmt::format("runs cover {} elements, {} bytes of values follow", k, values));
  }
  if constexpr (CheckFirst) {
    const uint8_t* v = p;
    p = first_run;
    at = 0;
    for (uint64_t i = 0; i < r; ++i) {
      uint64_t skip = 0, len = 0;
      get_varint(&p, end, &skip);
      get_varint(&p, end, &len);
      at += skip;
      visit(whole, at, len, v);
      v += len * elem;
      at += len;
    }
  }
  return k;
}

// Walks an encoding's changed elements without trusting it: `visit(element, value)` for each, in
// order, only after the whole encoding was checked (so a bad one writes nothing).
template <typename Visit>
Result<uint64_t> walk(DeltaEncoding encoding, const uint8_t* enc, size_t bytes, size_t n, size_t elem, Visit visit) {
  if (elem == 0) return bad("elements of 0 bytes");
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
  return walk_runs<true, false>(enc, bytes, n, elem,
                                [&](const RunsChunk&, uint64_t at, uint64_t len, const uint8_t* v) {
                                  for (uint64_t e = 0; e < len; ++e, v += elem) visit(static_cast<size_t>(at + e), v);
                                });
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

size_t varint_bytes(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

DeltaEncoding choose_delta(uint64_t k, size_t n, size_t elem, bool prefer_delta,
                           std::optional<std::pair<uint64_t, size_t>> runs) {
  const size_t value_bytes = static_cast<size_t>(k) * elem;
  const size_t map_bytes = (n + 7) / 8;
  const size_t by_bitmap = map_bytes + value_bytes;
  const size_t by_runs = runs ? varint_bytes(runs->first) + runs->second + value_bytes : SIZE_MAX;
  if (!prefer_delta && std::min(by_bitmap, by_runs) >= n * elem) return DeltaEncoding::kDense;
  return by_runs <= by_bitmap ? DeltaEncoding::kRuns : DeltaEncoding::kBitmap;
}

DeltaChoice encode_scanned(const uint8_t* bitmap, const uint8_t* values, uint64_t k, size_t n, size_t elem,
                           bool prefer_delta, std::vector<uint8_t>& out) {
  thread_local Scratch runs_memory;
  const size_t map_bytes = (n + 7) / 8;
  // The runs' varints, for as long as they stay smaller than the bitmap (past it, the bitmap wins).
  uint8_t* runs = runs_memory.get(map_bytes + kRunsSlack);
  const auto found = runs_of(bitmap, n, map_bytes, runs);
  const ValueSpan span{values, static_cast<size_t>(k) * elem};
  const DeltaChoice choice = encode_found(bitmap, {&span, 1}, k, n, elem, prefer_delta, found, runs, out);
  runs_memory.trim();
  return choice;
}

DeltaChoice encode_found(const uint8_t* bitmap, std::span<const ValueSpan> values, uint64_t k, size_t n, size_t elem,
                         bool prefer_delta, std::optional<std::pair<uint64_t, size_t>> found, const uint8_t* runs,
                         std::vector<uint8_t>& out) {
  out.clear();
  const size_t map_bytes = (n + 7) / 8;
  const DeltaChoice choice{choose_delta(k, n, elem, prefer_delta, found), k};
  const size_t value_bytes = static_cast<size_t>(k) * elem;
  uint8_t* o = nullptr;
  if (choice.encoding == DeltaEncoding::kRuns) {
    out.resize(varint_bytes(found->first) + found->second + value_bytes);
    o = put_varint(out.data(), found->first);
    std::memcpy(o, runs, found->second);
    o += found->second;
  } else if (choice.encoding == DeltaEncoding::kBitmap) {
    out.resize(map_bytes + value_bytes);
    std::memcpy(out.data(), bitmap, map_bytes);
    o = out.data() + map_bytes;
  } else {
    return choice;
  }
  for (const ValueSpan& v : values) {
    if (v.bytes != 0) std::memcpy(o, v.data, v.bytes);
    o += v.bytes;
  }
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

// unpack_field() for a caller that keeps what it points into: a zstd frame's contents are copied into
// `kept` (the thread's scratch is given back).
Result<std::pair<const uint8_t*, size_t>> unpack_kept(uint32_t field, const uint8_t* encoded, size_t bytes, size_t n,
                                                      size_t elem, std::vector<uint8_t>& kept) {
  thread_local Scratch inflated;
  const TrimOnExit trim{inflated};
  FERRY_ASSIGN_OR_RETURN(auto got, unpack_field(field, encoded, bytes, n, elem, inflated));
  if ((field & kDeltaZstd) != 0) {
    kept.assign(got.first, got.first + got.second);
    got.first = kept.data();
  }
  return got;
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
  FERRY_ASSIGN_OR_RETURN(const auto bytes, unpack_kept(field, encoded, encoded_bytes, n, elem, out.inflated));
  const auto encoding = static_cast<DeltaEncoding>(field & 0xff);
  // A bitmap encoding goes as it is, its header checked; a runs encoding is checked as apply_delta
  // checks it, in one pass that also sets its runs in a bitmap of its own (used only once the whole
  // encoding is good). The values end either, in order.
  if (encoding == DeltaEncoding::kBitmap) {
    FERRY_ASSIGN_OR_RETURN(out.changed, check_bitmap(bytes.first, bytes.second, n, elem));
    out.bitmap = bytes.first;
  } else {
    if (encoding != DeltaEncoding::kRuns) {
      return bad(fmt::format("unknown encoding {}", static_cast<uint32_t>(encoding)));
    }
    out.built.assign((n + 7) / 8, 0);
    uint8_t* map = out.built.data();
    // Bits [at, at + len) of each run: the partial bytes at either end bit by bit, the whole ones
    // between at once. Runs are set on several threads for a large encoding: a chunk's first and
    // last bytes may hold bits of its neighbours' runs, and are set atomically.
    const auto set = [map](const RunsChunk& c, uint64_t at, uint64_t len, const uint8_t*) {
      const uint64_t shared_first = c.at / 8, shared_last = (c.stop - 1) / 8;
      const auto mark = [&](uint64_t e) {
        const uint64_t byte = e / 8;
        const auto bit = static_cast<uint8_t>(1u << (e % 8));
        if (!c.alone && (byte == shared_first || byte == shared_last)) {
          std::atomic_ref<uint8_t>(map[byte]).fetch_or(bit, std::memory_order_relaxed);
        } else {
          map[byte] |= bit;
        }
      };
      uint64_t e = at;
      const uint64_t stop = at + len;
      for (; e < stop && e % 8 != 0; ++e) mark(e);
      if (stop - e >= 8) {
        std::memset(map + e / 8, 0xff, static_cast<size_t>((stop - e) / 8));
        e += (stop - e) / 8 * 8;
      }
      for (; e < stop; ++e) mark(e);
    };
    FERRY_ASSIGN_OR_RETURN(out.changed, (walk_runs<false, true>(bytes.first, bytes.second, n, elem, set)));
    out.bitmap = map;
  }
  out.values = bytes.first + bytes.second - static_cast<size_t>(out.changed) * elem;
  return ok_status();
}

Status delta_runs(uint32_t field, const uint8_t* encoded, size_t encoded_bytes, size_t n, size_t elem, DeltaRuns& out) {
  out.inflated.clear();
  out.pairs = out.values = nullptr;
  out.pair_bytes = 0;
  out.runs = out.changed = 0;
  out.xor_values = (field & kDeltaXor) != 0;
  if (elem == 0) return bad("elements of 0 bytes");
  if ((field & 0xff) != static_cast<uint32_t>(DeltaEncoding::kRuns)) return bad("not a runs encoding");
  FERRY_ASSIGN_OR_RETURN(const auto bytes, unpack_kept(field, encoded, encoded_bytes, n, elem, out.inflated));
  const uint8_t* end = bytes.first + bytes.second;
  const uint8_t* p = bytes.first;
  uint64_t r = 0;
  if (!get_varint(&p, end, &r)) return bad("runs: no count");
  if (r > bytes.second / 2) return bad(fmt::format("{} runs in {} bytes", r, bytes.second));
  const uint8_t* values = detail::past_varints(p, end, 2 * r);
  if (values == nullptr) return bad("runs: truncated");
  const auto value_bytes = static_cast<size_t>(end - values);
  if (value_bytes % elem != 0) return bad(fmt::format("{} bytes of values of {} bytes each", value_bytes, elem));
  out.pairs = p;
  out.pair_bytes = static_cast<size_t>(values - p);
  out.runs = r;
  out.values = values;
  out.changed = value_bytes / elem;
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
                   std::vector<std::pair<uint64_t, uint64_t>>* changed, uint64_t granularity) {
  thread_local Scratch inflated;
  const TrimOnExit trim{inflated};
  FERRY_ASSIGN_OR_RETURN(const auto bytes, unpack_field(field, encoded, encoded_bytes, n, elem, inflated));
  const auto encoding = static_cast<DeltaEncoding>(field & 0xff);
  const bool xor_values = (field & kDeltaXor) != 0;
  // The runs written, handed to the caller only once the whole encoding was applied.
  std::vector<std::pair<uint64_t, uint64_t>> written;
  // [at, at + len) written into `out` as a run, widened to whole units of `granularity` elements,
  // one with the run before it when they touch. Runs come in order: one inside the last noted costs
  // a compare (at a few percent changed, a row of a thousand elements holds tens).
  const uint64_t unit = std::max<uint64_t>(granularity, 1);
  const auto note = [unit, n](std::vector<std::pair<uint64_t, uint64_t>>& out, uint64_t at, uint64_t len) {
    uint64_t end = at + len;
    if (!out.empty() && end <= out.back().first + out.back().second) return;
    if (unit > 1) {
      at = at / unit * unit;
      end = std::min<uint64_t>((end + unit - 1) / unit * unit, n);
    }
    if (!out.empty() && out.back().first + out.back().second >= at) {
      out.back().second = end - out.back().first;
    } else {
      out.emplace_back(at, end - at);
    }
  };
  if (encoding != DeltaEncoding::kRuns) {
    // Element by element; walk() checks the whole encoding first, so a bad one writes nothing.
    FERRY_RETURN_IF_ERROR(walk(encoding, bytes.first, bytes.second, n, elem, [&](size_t e, const uint8_t* v) {
                            uint8_t* at = values + e * elem;
                            if (xor_values) {
                              for (size_t i = 0; i < elem; ++i) at[i] ^= v[i];
                            } else {
                              std::memcpy(at, v, elem);
                            }
                            if (changed != nullptr) note(written, e, 1);
                          }).status());
    if (changed != nullptr) *changed = std::move(written);
    return ok_status();
  }
  // Run by run, after the whole encoding was checked; a large one's chunks on several threads, each
  // noting its runs apart, joined in order after.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> noted(changed != nullptr ? detail::kMaxRunsChunks : 0);
  FERRY_RETURN_IF_ERROR((walk_runs<true, true>)(bytes.first, bytes.second, n, elem,
                                                [&](const RunsChunk& c, uint64_t at, uint64_t len, const uint8_t* v) {
                                                  uint8_t* to = values + at * elem;
                                                  const size_t b = static_cast<size_t>(len) * elem;
                                                  if (xor_values) {
                                                    for (size_t i = 0; i < b; ++i) to[i] ^= v[i];
                                                  } else {
                                                    std::memcpy(to, v, b);
                                                  }
                                                  if (changed != nullptr)
                                                    note(c.alone ? written : noted[c.index], at, len);
                                                })
                            .status());
  for (const auto& runs : noted) {
    for (const auto& [at, len] : runs) note(written, at, len);
  }
  if (changed != nullptr) *changed = std::move(written);
  return ok_status();
}

}  // namespace ferry::dataplane

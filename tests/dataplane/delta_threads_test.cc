// The delta codec's work on several threads (dataplane/delta_scan.h): large pieces compared and
// their runs found in slices, and large runs encodings checked and applied in chunks, each against
// what one element-by-element pass gives (tests/dataplane/delta_reference.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"
#include "tests/dataplane/delta_reference.h"

namespace ferry::dataplane {
namespace {

using namespace delta_ref;  // NOLINT: the references

// The codec's work spread over `threads` (FERRY_THREADS), whatever this machine's cores: every
// slicing the scans may take, on any host.
struct WithThreads {
  explicit WithThreads(size_t threads) : was(host_threads()) { set_host_threads(threads); }
  ~WithThreads() { set_host_threads(was); }
  size_t was;
};

// A piece large enough to be compared by several threads: runs that cross the threads' slices
// come out whole, and the encoding is the one an element-by-element scan gives.
TEST(Delta, LargePiecesEncodeAsOneScanWould) {
  const size_t n = size_t{9} << 20, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, n / 1000, 21);
  // Runs across every multiple of 1 Mi elements, whatever the slices are.
  for (size_t b = size_t{1} << 20; b < n; b += size_t{1} << 20) {
    for (size_t e = b - 5; e < b + 5; ++e) after[e * elem] ^= 0x10;
  }
  Bytes enc;
  const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, false, enc);
  ASSERT_EQ(c.encoding, DeltaEncoding::kRuns);
  EXPECT_TRUE(enc == reference_runs(before, after, elem)) << "encoded " << enc.size() << " bytes";
  Bytes got = before;
  ASSERT_TRUE(apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem).ok());
  EXPECT_TRUE(got == after);
}

// The same with XOR values, and runs across the threads' actual slice boundaries for every thread
// count the scan may take (2 to 16: each slice (n / threads) rounded down to a multiple of 8): the
// values of every slice are closed up in order.
TEST(Delta, LargeXorPiecesEncodeAsOneScanWouldAcrossEverySlice) {
  const size_t n = (size_t{9} << 20) + 5, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, n / 1000, 23);
  for (size_t threads = 2; threads <= 16; ++threads) {
    const size_t step = (n / threads) & ~size_t{7};
    for (size_t t = 1; t < threads; ++t) {
      for (size_t e = t * step - 8; e < t * step + 8; ++e) after[e * elem + 1] ^= 0x01;
    }
  }
  const Bytes want = reference_runs(before, after, elem, true);
  // On each thread count, under each compare this CPU has (AVX-512, AVX2, and the narrow one).
  for (size_t threads = 1; threads <= 16; ++threads) {
    const WithThreads spread(threads);
    for (const detail::ScanKind kind : detail::scans_available()) {
      SCOPED_TRACE(std::string(detail::scan_name(kind)) + " on " + std::to_string(threads) + " threads");
      const detail::ScanKind was = detail::use_scan(kind);
      Bytes enc;
      const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, false, enc, /*xor_values=*/true);
      detail::use_scan(was);
      ASSERT_EQ(c.encoding, DeltaEncoding::kRuns);
      EXPECT_EQ(c.changed, count_changed(before, after, elem));
      EXPECT_TRUE(enc == want) << "encoded " << enc.size() << " bytes";
      Bytes got = before;
      ASSERT_TRUE(
          apply_delta(static_cast<uint32_t>(c.encoding) | kDeltaXor, enc.data(), enc.size(), got.data(), n, elem).ok());
      EXPECT_TRUE(got == after);
    }
  }
}

// A slice whose every element changed, of 1-byte elements, ahead of one whose first elements
// changed: the first slice's values end exactly where the second's room begins, and a store past
// them would overwrite the second's first values while its thread writes them. On 2 to 16 threads,
// under each compare this CPU has.
TEST(Delta, AWhollyChangedSliceLeavesTheNextSlicesValuesAlone) {
  const size_t n = (size_t{512} << 10) + 21, elem = 1;
  for (size_t threads = 2; threads <= 16; ++threads) {
    const WithThreads spread(threads);
    const size_t step = (n / std::min<size_t>(threads, n >> 17)) & ~size_t{7};
    Bytes before(n, 0), after(n, 0);
    for (size_t e = 0; e < step; ++e) after[e] = static_cast<uint8_t>(1 + e % 251);
    for (size_t e = step; e < n; e += step) {
      for (size_t k = e; k < std::min(n, e + 5); ++k) after[k] = static_cast<uint8_t>(7 + k % 13);
    }
    Bytes want;
    for (size_t e = 0; e < n; ++e) {
      if (after[e] != before[e]) want.push_back(after[e]);
    }
    for (const detail::ScanKind kind : detail::scans_available()) {
      SCOPED_TRACE(std::string(detail::scan_name(kind)) + " on " + std::to_string(threads) + " threads");
      const detail::ScanKind was = detail::use_scan(kind);
      Bytes bitmap((n + 63) / 64 * 8 + 16, 0), values(n + 64, 0xee);
      const uint64_t k =
          detail::scan_parallel(before.data(), after.data(), n, elem, false, bitmap.data(), values.data());
      detail::use_scan(was);
      ASSERT_EQ(k, want.size());
      EXPECT_TRUE(std::equal(want.begin(), want.end(), values.begin()));
    }
  }
}

// The runs of a large piece are found on several threads, each a slice of whole 64-element words
// (n / threads rounded down to a multiple of 64, for every thread count the encoder may take):
// runs that cross a border, that end or begin exactly at one (so that two slices' runs touch and
// are one), slices with no change at all, and a run over whole slices come out as one scan gives.
TEST(Delta, RunsFoundOnSeveralThreadsAreTheRunsOfOneScan) {
  const size_t n = (size_t{9} << 20) + 77, elem = 1;
  Bytes before(n, 0), after(n, 0);
  const auto change = [&](size_t e) { after[e] = 1; };
  for (size_t threads = 2; threads <= 8; ++threads) {
    const size_t step = (n / threads) & ~size_t{63};
    for (size_t t = 1; t < threads; ++t) {
      const size_t b = t * step;
      switch ((threads + t) % 4) {
        case 0:
          for (size_t e = b - 3; e < b + 3; ++e) change(e);
          break;  // across
        case 1:
          for (size_t e = b - 5; e < b; ++e) change(e);
          break;  // ends at the border
        case 2:
          for (size_t e = b; e < b + 5; ++e) change(e);
          break;                                   // begins there
        default: change(b - 1), change(b); break;  // touching halves
      }
    }
  }
  // One run over several whole slices (from 4 threads up), and a few lone changes.
  for (size_t e = n * 3 / 10; e < n * 85 / 100; ++e) change(e);
  for (size_t e : {size_t{0}, size_t{64}, n - 1}) change(e);
  for (size_t threads = 1; threads <= 8; ++threads) {
    const WithThreads spread(threads);
    const bool prefer = threads % 2 == 0;
    SCOPED_TRACE(std::to_string(threads) + " threads");
    Bytes enc;
    const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, prefer, enc);
    ASSERT_EQ(c.encoding, DeltaEncoding::kRuns);
    EXPECT_TRUE(enc == reference_runs(before, after, elem)) << "encoded " << enc.size() << " bytes";
    Bytes got = before;
    ASSERT_TRUE(apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem).ok());
    EXPECT_TRUE(got == after);
  }
  // Every other element changed: the runs outgrow the bitmap in every slice, and the bitmap goes.
  for (size_t e = 0; e < n; e += 2) change(e);
  Bytes enc;
  const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, /*prefer_delta=*/true, enc);
  ASSERT_EQ(c.encoding, DeltaEncoding::kBitmap);
  EXPECT_EQ(c.changed, count_changed(before, after, elem));
  Bytes got = before;
  ASSERT_TRUE(apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem).ok());
  EXPECT_TRUE(got == after);
}

// A runs encoding of hundreds of thousands of runs is checked and applied in chunks on several
// threads (as many as the machine has, 8 at most): the values, the runs noted as changed (joined
// where two chunks' runs touch), and the bitmap the device shadow's decoder builds are those of one
// scan; an encoding bad in a later chunk is refused with the single pass's words, nothing written.
TEST(Delta, LargeRunsEncodingsAreAppliedInChunksAsOnePassWould) {
  const size_t n = (size_t{4} << 20) + 3, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, n / 7, 31);
  // The last run is the last element alone.
  after[(n - 1) * elem] ^= 1;
  std::memcpy(&after[(n - 2) * elem], &before[(n - 2) * elem], elem);
  const Bytes enc = reference_runs(before, after, elem);
  const auto runs = reference_changed(before, after, elem);
  ASSERT_GT(runs.size(), size_t{8} << 15);  // enough for 8 chunks
  const auto field = static_cast<uint32_t>(DeltaEncoding::kRuns);
  {  // It is shared out, on a machine of more than one thread.
    const uint8_t* pairs = enc.data();
    uint64_t r = 0;
    ASSERT_TRUE(detail::get_varint(&pairs, enc.data() + enc.size(), &r));
    const auto split = detail::split_runs(pairs, enc.data() + enc.size(), r, n, elem);
    if (std::thread::hardware_concurrency() >= 2) {
      ASSERT_TRUE(split.has_value());
      EXPECT_GE(split->chunks.size(), 2u);
      EXPECT_EQ(split->changed, count_changed(before, after, elem));
    }
  }
  {
    Bytes got = before;
    std::vector<std::pair<uint64_t, uint64_t>> changed;
    ASSERT_TRUE(apply_delta(field, enc.data(), enc.size(), got.data(), n, elem, &changed).ok());
    EXPECT_TRUE(got == after);
    EXPECT_TRUE(changed == runs) << changed.size() << " runs noted of " << runs.size();
    // Noted by rows of 3 and of 1,000 elements (a caller that needs the rows a delta wrote in): the rows
    // holding a changed element, as runs of whole rows (the last row short), merged when they touch.
    for (const uint64_t per_row : {uint64_t{3}, uint64_t{1000}}) {
      Bytes again = before;
      std::vector<std::pair<uint64_t, uint64_t>> rows, want;
      ASSERT_TRUE(apply_delta(field, enc.data(), enc.size(), again.data(), n, elem, &rows, per_row).ok());
      EXPECT_TRUE(again == after);
      for (const auto& [first, len] : runs) {
        for (uint64_t r = first / per_row; r <= (first + len - 1) / per_row; ++r) {
          const uint64_t lo = r * per_row, hi = std::min<uint64_t>(lo + per_row, n);
          if (!want.empty() && want.back().first + want.back().second >= lo) {
            want.back().second = std::max(want.back().first + want.back().second, hi) - want.back().first;
          } else {
            want.emplace_back(lo, hi - lo);
          }
        }
      }
      EXPECT_TRUE(rows == want) << rows.size() << " row runs noted of " << want.size() << ", rows of " << per_row;
      // The same rows from a bitmap encoding (noted element by element).
      std::vector<uint8_t> bitmap;
      ASSERT_EQ(encode_delta(before.data(), after.data(), n, elem, false, bitmap).encoding, DeltaEncoding::kBitmap);
      again = before;
      rows.clear();
      ASSERT_TRUE(
          apply_delta(DeltaEncoding::kBitmap, bitmap.data(), bitmap.size(), again.data(), n, elem, &rows, per_row)
              .ok());
      EXPECT_TRUE(again == after);
      EXPECT_TRUE(rows == want) << rows.size() << " row runs noted from a bitmap of " << want.size();
    }
    DeltaBitmap bits;
    ASSERT_TRUE(delta_bitmap(field, enc.data(), enc.size(), n, elem, bits).ok());
    Bytes map((n + 7) / 8, 0);
    for (const auto& [first, len] : runs) {
      for (uint64_t e = first; e < first + len; ++e) map[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
    }
    EXPECT_EQ(std::memcmp(bits.bitmap, map.data(), map.size()), 0);
    EXPECT_EQ(bits.changed, count_changed(before, after, elem));
    EXPECT_EQ(bits.values, enc.data() + enc.size() - bits.changed * elem);
  }
  {  // XOR values into the old ones.
    const Bytes xenc = reference_runs(before, after, elem, /*xor_values=*/true);
    Bytes got = before;
    ASSERT_TRUE(apply_delta(field | kDeltaXor, xenc.data(), xenc.size(), got.data(), n, elem).ok());
    EXPECT_TRUE(got == after);
  }
  {  // Every run one element right after the last: they touch across every chunk's border (and share
     // its bitmap byte), and are noted as one run.
    const size_t r = (size_t{1} << 18) + 5;  // chunk borders inside bitmap bytes
    Bytes touching;
    for (uint64_t v = r; v >= 0x80; v >>= 7) touching.push_back(static_cast<uint8_t>(v | 0x80));
    touching.push_back(static_cast<uint8_t>(r >> (7 * (touching.size()))));
    for (size_t i = 0; i < r; ++i) touching.insert(touching.end(), {0, 1});
    for (size_t i = 0; i < r * elem; ++i) touching.push_back(static_cast<uint8_t>(i * 7 + 1));
    Bytes got = before;
    std::vector<std::pair<uint64_t, uint64_t>> changed;
    ASSERT_TRUE(apply_delta(field, touching.data(), touching.size(), got.data(), n, elem, &changed).ok());
    ASSERT_EQ(changed.size(), 1u);
    EXPECT_EQ(changed[0], (std::pair<uint64_t, uint64_t>{0, r}));
    EXPECT_EQ(std::memcmp(got.data(), touching.data() + touching.size() - r * elem, r * elem), 0);
    EXPECT_EQ(std::memcmp(got.data() + r * elem, before.data() + r * elem, (n - r) * elem), 0);
    DeltaBitmap bits;
    ASSERT_TRUE(delta_bitmap(field, touching.data(), touching.size(), n, elem, bits).ok());
    const Bytes ones(r / 8, 0xff);
    EXPECT_EQ(std::memcmp(bits.bitmap, ones.data(), ones.size()), 0);
    EXPECT_EQ(bits.bitmap[r / 8], (1u << (r % 8)) - 1);
    EXPECT_EQ(bits.bitmap[r / 8 + 1], 0);
  }
  // Bad in the last three quarters: each refused as the single pass refuses it.
  const size_t header = enc.size() - count_changed(before, after, elem) * elem;
  struct Bad {
    const char* what;
    Bytes bytes;
    size_t n;
    const char* says;
  };
  std::vector<Bad> bad;
  {
    Bytes b = enc;
    // The first length of 1 (a one-byte varint, the second of its pair) in the last quarter, set to 0.
    size_t at = 0, index = 0;
    while (enc[at] >= 0x80) ++at;  // the count
    for (size_t start = ++at; at < header; ++at) {
      if (enc[at] >= 0x80) continue;
      if (index++ % 2 == 1 && at == start && enc[at] == 1 && at > header * 3 / 4) break;
      start = at + 1;
    }
    if (at < header) {
      b[at] = 0;
      bad.push_back({"a run of 0 elements", b, n, "run of 0 elements"});
    }
  }
  bad.push_back({"a run past the end", enc, n - 1, "run of 1 elements"});
  bad.push_back({"a value too few", Bytes(enc.begin(), enc.end() - elem), n, "runs cover"});
  {
    Bytes b = enc;
    b.insert(b.begin() + static_cast<std::ptrdiff_t>(header * 5 / 6), 10, 0x80);
    bad.push_back({"a varint of 11 bytes", b, n, "runs: truncated"});
  }
  bad.push_back(
      {"pairs cut short", Bytes(enc.begin(), enc.begin() + static_cast<std::ptrdiff_t>(header / 2)), n, "runs in"});
  ASSERT_EQ(bad.size(), 5u) << "no length of 1 found to spoil";
  for (const Bad& c : bad) {
    Bytes values = before;
    std::vector<std::pair<uint64_t, uint64_t>> changed = {{7, 7}};
    Status st = apply_delta(field, c.bytes.data(), c.bytes.size(), values.data(), c.n, elem, &changed);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << c.what << ": " << st.to_string();
    EXPECT_NE(st.message().find(c.says), std::string::npos) << c.what << ": " << st.to_string();
    EXPECT_TRUE(values == before) << c.what << " wrote values";
    EXPECT_EQ(changed.size(), 1u) << c.what << ": the caller's runs were touched";
    DeltaBitmap bits;
    EXPECT_EQ(delta_bitmap(field, c.bytes.data(), c.bytes.size(), c.n, elem, bits).code(), StatusCode::kDataLoss)
        << c.what;
  }
}

}  // namespace
}  // namespace ferry::dataplane

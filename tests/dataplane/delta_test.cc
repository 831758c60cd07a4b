// The delta codec (dataplane/delta.h): round trips at the change rates RL steps produce, the choice
// between encodings and dense bytes, and encodings off a wire that do not describe the piece.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include <zstd.h>

#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"

namespace ferry::dataplane {
namespace {

using Bytes = std::vector<uint8_t>;

// `n` elements of `elem` bytes, and a copy with `changed` of them (a random subset) altered.
std::pair<Bytes, Bytes> pair_with_changes(size_t n, size_t elem, size_t changed, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes before(n * elem);
  for (auto& b : before) b = static_cast<uint8_t>(rng());
  Bytes after = before;
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), rng);
  for (size_t k = 0; k < changed; ++k) {
    // Flip one byte of the element: it differs, however the others compare.
    after[idx[k] * elem + rng() % elem] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  return {before, after};
}

size_t count_changed(const Bytes& a, const Bytes& b, size_t elem) {
  size_t k = 0;
  for (size_t i = 0; i < a.size() / elem; ++i) k += std::memcmp(&a[i * elem], &b[i * elem], elem) != 0;
  return k;
}

TEST(Delta, RoundTripsAtEveryChangeRate) {
  for (size_t elem : {1, 2, 4}) {
    for (double rate : {0.0, 0.001, 0.03, 0.3, 1.0}) {
      const size_t n = 40'003;  // not a multiple of 8: the bitmap's last byte is partial
      auto [before, after] = pair_with_changes(n, elem, static_cast<size_t>(rate * n), 7 + elem);
      for (bool prefer : {false, true}) {
        Bytes enc;
        const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, prefer, enc);
        EXPECT_EQ(c.changed, count_changed(before, after, elem)) << elem << " " << rate;
        if (c.encoding == DeltaEncoding::kDense) {
          EXPECT_FALSE(prefer);
          EXPECT_TRUE(enc.empty());
          EXPECT_GE(rate, 0.3) << "a sparse change went dense";
          continue;
        }
        EXPECT_LT(enc.size(), prefer ? n * elem + n / 8 + 16 : n * elem);
        Bytes got = before;
        Status st = apply_delta(c.encoding, enc.data(), enc.size(), got.data(), n, elem);
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(got, after) << "elem " << elem << " rate " << rate << " " << encoding_name(c.encoding);
        auto k = delta_changed(c.encoding, enc.data(), enc.size(), n, elem);
        ASSERT_TRUE(k.ok());
        EXPECT_EQ(*k, c.changed);
      }
    }
  }
}

// FERRY_DELTA_ZSTD: the values as XORs with the old ones, the encoding in a zstd frame when that
// saves an eighth; applied, the piece is exactly the new values at every rate and width.
TEST(Delta, XorValuesInAZstdFrameRoundTrip) {
  for (size_t elem : {1, 2, 4, 8}) {
    for (double rate : {0.0, 0.001, 0.03, 0.3, 1.0}) {
      const size_t n = 40'003;
      auto [before, after] = pair_with_changes(n, elem, static_cast<size_t>(rate * n), 11 + elem);
      Bytes enc;
      const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, /*prefer_delta=*/true, enc,
                                         /*xor_values=*/true);
      ASSERT_NE(c.encoding, DeltaEncoding::kDense);
      const size_t raw = enc.size();
      uint32_t field = static_cast<uint32_t>(c.encoding) | kDeltaXor;
      if (compress_delta(enc, 1)) {
        field |= kDeltaZstd;
        EXPECT_LE(enc.size(), raw - raw / 8);
      }
      Bytes got = before;
      Status st = apply_delta(field, enc.data(), enc.size(), got.data(), n, elem);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(got, after) << "elem " << elem << " rate " << rate << " field " << field;
      auto k = delta_changed(field, enc.data(), enc.size(), n, elem);
      ASSERT_TRUE(k.ok()) << k.status().to_string();
      EXPECT_EQ(*k, c.changed);
    }
  }
  // Steps of one ulp on 3% of bf16 values (as Adam at a small learning rate makes): the frame is
  // well under the plain encoding.
  const size_t n = 1 << 18;
  std::mt19937_64 rng(5);
  Bytes before(n * 2), after;
  for (size_t e = 0; e < n; ++e)
    before[e * 2 + 1] = static_cast<uint8_t>(0x3c + rng() % 4), before[e * 2] = static_cast<uint8_t>(rng());
  after = before;
  for (size_t e = 0; e < n; ++e) {
    if (rng() % 100 < 3) after[e * 2] = static_cast<uint8_t>(after[e * 2] + 1);
  }
  Bytes plain, framed;
  encode_delta(before.data(), after.data(), n, 2, false, plain);
  const DeltaChoice c = encode_delta(before.data(), after.data(), n, 2, false, framed, true);
  ASSERT_TRUE(compress_delta(framed, 1));
  EXPECT_LT(framed.size(), plain.size() * 3 / 4) << plain.size() << " plain";
  Bytes got = before;
  ASSERT_TRUE(apply_delta(static_cast<uint32_t>(c.encoding) | kDeltaXor | kDeltaZstd, framed.data(), framed.size(),
                          got.data(), n, 2)
                  .ok());
  EXPECT_TRUE(got == after);
}

TEST(Delta, PicksTheSmallerEncoding) {
  const size_t n = 8192, elem = 2;
  // A few scattered changes: runs are smaller than a bitmap of every element.
  auto [b1, a1] = pair_with_changes(n, elem, 10, 1);
  Bytes enc;
  EXPECT_EQ(encode_delta(b1.data(), a1.data(), n, elem, false, enc).encoding, DeltaEncoding::kRuns);
  EXPECT_LT(enc.size(), 10 * (elem + 6) + 4);
  // Every other element changed: a run per element costs more than one bit each.
  Bytes b2(n * elem, 0), a2 = b2;
  for (size_t i = 0; i < n; i += 2) a2[i * elem] = 1;
  EXPECT_EQ(encode_delta(b2.data(), a2.data(), n, elem, false, enc).encoding, DeltaEncoding::kBitmap);
  EXPECT_EQ(enc.size(), n / 8 + (n / 2) * elem);
  // Nothing changed: a count of zero runs.
  EXPECT_EQ(encode_delta(b2.data(), b2.data(), n, elem, false, enc).encoding, DeltaEncoding::kRuns);
  EXPECT_EQ(enc.size(), 1u);
  // Everything changed: dense, unless a delta is preferred.
  Bytes a3 = b2;
  for (size_t i = 0; i < n; ++i) a3[i * elem + 1] = 7;
  EXPECT_EQ(encode_delta(b2.data(), a3.data(), n, elem, false, enc).encoding, DeltaEncoding::kDense);
  EXPECT_NE(encode_delta(b2.data(), a3.data(), n, elem, true, enc).encoding, DeltaEncoding::kDense);
}

// The runs encoding as the format defines it, from a plain element-by-element scan; with
// `xor_values`, each value new XOR old (kDeltaXor).
Bytes reference_runs(const Bytes& before, const Bytes& after, size_t elem, bool xor_values = false) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  const size_t n = before.size() / elem;
  for (size_t e = 0; e < n; ++e) {
    if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == e) {
      ++runs.back().second;
    } else {
      runs.emplace_back(e, 1);
    }
  }
  Bytes out;
  const auto varint = [&out](uint64_t v) {
    for (; v >= 0x80; v >>= 7) out.push_back(static_cast<uint8_t>(v | 0x80));
    out.push_back(static_cast<uint8_t>(v));
  };
  varint(runs.size());
  uint64_t at = 0;
  for (const auto& [first, len] : runs) {
    varint(first - at);
    varint(len);
    at = first + len;
  }
  for (const auto& [first, len] : runs) {
    for (size_t b = first * elem; b < (first + len) * elem; ++b) {
      out.push_back(static_cast<uint8_t>(xor_values ? after[b] ^ before[b] : after[b]));
    }
  }
  return out;
}

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
// count the scan may take (2 to 8: each slice (n / threads) rounded down to a multiple of 8): the
// values of every slice are closed up in order.
TEST(Delta, LargeXorPiecesEncodeAsOneScanWouldAcrossEverySlice) {
  const size_t n = (size_t{9} << 20) + 5, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, n / 1000, 23);
  for (size_t threads = 2; threads <= 8; ++threads) {
    const size_t step = (n / threads) & ~size_t{7};
    for (size_t t = 1; t < threads; ++t) {
      for (size_t e = t * step - 8; e < t * step + 8; ++e) after[e * elem + 1] ^= 0x01;
    }
  }
  Bytes enc;
  const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, false, enc, /*xor_values=*/true);
  ASSERT_EQ(c.encoding, DeltaEncoding::kRuns);
  EXPECT_EQ(c.changed, count_changed(before, after, elem));
  EXPECT_TRUE(enc == reference_runs(before, after, elem, true)) << "encoded " << enc.size() << " bytes";
  Bytes got = before;
  ASSERT_TRUE(
      apply_delta(static_cast<uint32_t>(c.encoding) | kDeltaXor, enc.data(), enc.size(), got.data(), n, elem).ok());
  EXPECT_TRUE(got == after);
}

// A device's scan handed to the host (encode_scanned: the bitmap and the changed values, as the
// compare kernel writes them) encodes exactly what encode_delta does from the two buffers; and the
// bitmap a receiver decodes for a device shadow (delta_bitmap), its values written over the old
// ones by a loop here, gives the new ones, for every encoding, with and without XORs and zstd.
TEST(Delta, AScanMadeElsewhereAndItsRunsAgreeWithTheHostCodec) {
  for (size_t elem : {1, 2, 4, 8}) {
    for (double rate : {0.0, 0.001, 0.03, 0.3, 1.0}) {
      const size_t n = 40'003;
      auto [before, after] = pair_with_changes(n, elem, static_cast<size_t>(rate * n), 31 + elem);
      for (bool xor_values : {false, true}) {
        SCOPED_TRACE(testing::Message() << "elem " << elem << " rate " << rate << " xor " << xor_values);
        Bytes bitmap((n + 63) / 64 * 8, 0), values;
        for (size_t e = 0; e < n; ++e) {
          if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
          bitmap[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
          for (size_t i = 0; i < elem; ++i) {
            values.push_back(xor_values ? after[e * elem + i] ^ before[e * elem + i] : after[e * elem + i]);
          }
        }
        for (bool prefer : {false, true}) {
          Bytes want, got;
          const DeltaChoice a = encode_delta(before.data(), after.data(), n, elem, prefer, want, xor_values);
          const DeltaChoice b =
              encode_scanned(bitmap.data(), values.data(), values.size() / elem, n, elem, prefer, got);
          EXPECT_EQ(a.encoding, b.encoding);
          EXPECT_EQ(a.changed, b.changed);
          EXPECT_TRUE(want == got);
          if (b.encoding == DeltaEncoding::kDense) continue;
          for (bool zstd : {false, true}) {
            Bytes enc = got;
            uint32_t field = static_cast<uint32_t>(b.encoding) | (xor_values ? kDeltaXor : 0u);
            if (zstd && compress_delta(enc, 1)) field |= kDeltaZstd;
            DeltaBitmap bits;
            ASSERT_TRUE(delta_bitmap(field, enc.data(), enc.size(), n, elem, bits).ok());
            EXPECT_EQ(bits.changed, b.changed);
            EXPECT_EQ(bits.xor_values, xor_values);
            EXPECT_TRUE(std::equal(bitmap.begin(), bitmap.begin() + static_cast<long>((n + 7) / 8), bits.bitmap));
            Bytes applied = before;
            const uint8_t* v = bits.values;
            for (size_t e = 0; e < n; ++e) {
              if ((bits.bitmap[e / 8] >> (e % 8) & 1) == 0) continue;
              for (size_t i = 0; i < elem; ++i) {
                applied[e * elem + i] = xor_values ? static_cast<uint8_t>(applied[e * elem + i] ^ v[i]) : v[i];
              }
              v += elem;
            }
            EXPECT_TRUE(applied == after) << "zstd " << zstd;
          }
        }
      }
    }
  }
  // A bad encoding is refused by delta_bitmap as by apply_delta.
  DeltaBitmap bits;
  const Bytes junk = {5, 1, 1};
  EXPECT_EQ(delta_bitmap(static_cast<uint32_t>(DeltaEncoding::kRuns), junk.data(), junk.size(), 100, 2, bits).code(),
            StatusCode::kDataLoss);
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
  for (bool prefer : {false, true}) {
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

// The runs an element-by-element scan finds, [first, first + length).
std::vector<std::pair<uint64_t, uint64_t>> reference_changed(const Bytes& before, const Bytes& after, size_t elem) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (size_t e = 0; e < before.size() / elem; ++e) {
    if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().second == e) {
      ++runs.back().second;
    } else {
      runs.emplace_back(e, 1);
    }
  }
  return runs;
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

// Every malformed encoding is refused with DataLoss, and the values stay as they were.
TEST(Delta, RefusesEncodingsThatDoNotDescribeThePiece) {
  const size_t n = 100, elem = 2;
  auto [before, after] = pair_with_changes(n, elem, 30, 3);
  Bytes runs, bitmap;
  ASSERT_EQ(encode_delta(before.data(), after.data(), n, elem, true, runs).encoding, DeltaEncoding::kBitmap);
  bitmap = runs;
  auto [b2, a2] = pair_with_changes(n, elem, 3, 4);
  ASSERT_EQ(encode_delta(b2.data(), a2.data(), n, elem, false, runs).encoding, DeltaEncoding::kRuns);

  struct Bad {
    const char* what;
    DeltaEncoding e;
    Bytes enc;
  };
  std::vector<Bad> cases;
  cases.push_back({"bitmap truncated", DeltaEncoding::kBitmap, Bytes(bitmap.begin(), bitmap.begin() + 5)});
  Bytes extra = bitmap;
  extra.push_back(0);
  cases.push_back({"a value too many", DeltaEncoding::kBitmap, extra});
  Bytes past = bitmap;
  past[n / 8] |= 0x80;  // bit 103 of 100 elements
  cases.push_back({"bit past the end", DeltaEncoding::kBitmap, past});
  cases.push_back({"runs truncated", DeltaEncoding::kRuns, Bytes(runs.begin(), runs.end() - 1)});
  cases.push_back({"run past the end", DeltaEncoding::kRuns, Bytes{1, 99, 5, 0, 0, 0, 0, 0, 0, 0, 0}});
  cases.push_back({"empty run", DeltaEncoding::kRuns, Bytes{1, 0, 0}});
  cases.push_back({"huge run count", DeltaEncoding::kRuns, Bytes{0xff, 0xff, 0xff, 0xff, 0x0f}});
  cases.push_back({"overlong varint", DeltaEncoding::kRuns, Bytes(12, 0x80)});
  cases.push_back({"unknown encoding", static_cast<DeltaEncoding>(9), runs});
  cases.push_back({"empty", DeltaEncoding::kRuns, Bytes{}});
  // zstd frames (kDeltaZstd): each one below is refused before anything is written.
  Bytes framed(214, 0);  // inflates past what any encoding of 100 2-byte elements takes (13 + 200 bytes)
  ASSERT_TRUE(compress_delta(framed, 1));
  const uint32_t runs_z = static_cast<uint32_t>(DeltaEncoding::kRuns) | kDeltaZstd;
  struct Frame {
    const char* what;
    Bytes bytes;
    const char* says;  // the refusal names the cause
  };
  std::vector<Frame> frames;
  frames.push_back({"frame inflating past any encoding of the piece", framed, "zstd frame of 214 bytes"});
  Bytes zeros(bitmap.size(), 0);
  ASSERT_TRUE(compress_delta(zeros, 1));
  frames.push_back({"frame of zeros: a bitmap with no values for its size", zeros, "bitmap marks 0 elements"});
  const Bytes real = runs;
  Bytes z(ZSTD_compressBound(real.size()));
  z.resize(ZSTD_compress(z.data(), z.size(), real.data(), real.size(), 1));
  frames.push_back({"frame truncated", Bytes(z.begin(), z.end() - 3), "zstd frame:"});
  frames.push_back({"not a frame", Bytes(runs.begin(), runs.end()), "without its size"});
  {
    // A frame that does not state its size.
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
    Bytes out(ZSTD_compressBound(real.size()));
    ZSTD_outBuffer o{out.data(), out.size(), 0};
    ZSTD_inBuffer i{real.data(), real.size(), 0};
    ZSTD_compressStream2(cctx, &o, &i, ZSTD_e_end);
    ZSTD_freeCCtx(cctx);
    out.resize(o.pos);
    frames.push_back({"frame without its size", out, "without its size"});
  }
  for (const auto& [what, bytes, says] : frames) {
    Bytes values = before;
    const uint32_t field = std::string_view(what).find("bitmap") != std::string_view::npos
                               ? static_cast<uint32_t>(DeltaEncoding::kBitmap) | kDeltaZstd
                               : runs_z;
    Status st = apply_delta(field, bytes.data(), bytes.size(), values.data(), n, elem);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << what << ": " << st.to_string();
    EXPECT_NE(st.message().find(says), std::string::npos) << what << ": " << st.to_string();
    EXPECT_EQ(values, before) << what << " wrote values";
  }
  // The same frame, whole, is taken (the cases above fail for what they say).
  {
    Bytes values = b2;
    ASSERT_TRUE(apply_delta(runs_z, z.data(), z.size(), values.data(), n, elem).ok());
    EXPECT_EQ(values, a2);
  }
  Bytes values = before;
  EXPECT_EQ(
      apply_delta(static_cast<uint32_t>(DeltaEncoding::kRuns) | 0x400, runs.data(), runs.size(), values.data(), n, elem)
          .code(),
      StatusCode::kDataLoss)
      << "unknown flag";
  for (DeltaEncoding e : {DeltaEncoding::kRuns, DeltaEncoding::kBitmap}) {
    const Bytes none = {0};
    EXPECT_EQ(apply_delta(e, none.data(), none.size(), values.data(), n, 0).code(), StatusCode::kDataLoss)
        << "elements of 0 bytes, " << encoding_name(e);
  }
  for (const Bad& c : cases) {
    Bytes values = before;
    Status st = apply_delta(c.e, c.enc.data(), c.enc.size(), values.data(), n, elem);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << c.what << ": " << st.to_string();
    EXPECT_EQ(values, before) << c.what << " wrote values";
  }
}

}  // namespace
}  // namespace ferry::dataplane

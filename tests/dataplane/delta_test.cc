// The delta codec (dataplane/delta.h): round trips at the change rates RL steps produce, the choice
// between encodings and dense bytes, a scan made elsewhere, and encodings off a wire that do not
// describe the piece. Large pieces on several threads: delta_threads_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

#include <zstd.h>

#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"
#include "tests/dataplane/delta_reference.h"

namespace ferry::dataplane {
namespace {

using namespace delta_ref;  // NOLINT: the references

// The compares a CPU may use (delta_scan.h): 64 bytes at a time where it has AVX-512, 32 with AVX2,
// and the narrow one every x86-64 has; each test below that scans runs under each this CPU has.
std::vector<detail::ScanKind> compares_here() { return detail::scans_available(); }
struct UseCompare {
  explicit UseCompare(detail::ScanKind kind) : was(detail::use_scan(kind)) {}
  ~UseCompare() { detail::use_scan(was); }
  detail::ScanKind was;
};

TEST(Delta, RoundTripsAtEveryChangeRate) {
  for (const detail::ScanKind kind : compares_here()) {
    SCOPED_TRACE(detail::scan_name(kind));
    const UseCompare compare(kind);
    for (size_t elem : {1, 2, 4, 8, 3}) {
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
}

// FERRY_DELTA_ZSTD: the values as XORs with the old ones, the encoding in a zstd frame when that
// saves an eighth; applied, the piece is exactly the new values at every rate and width.
TEST(Delta, XorValuesInAZstdFrameRoundTrip) {
  for (const detail::ScanKind kind : compares_here()) {
    SCOPED_TRACE(detail::scan_name(kind));
    const UseCompare compare(kind);
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

// The wide compares close the changed values up with a whole vector stored per group: every
// pattern of changes among 8 elements gives the bitmap and the values, in order, an element-by-
// element loop here gives, and no store lands past the piece's room for its values (n values) or
// its bitmap, under every compare this CPU has, for 1, 2 and 4 bytes, with and without XORs.
TEST(Delta, EveryPatternOfChangesInAGroupClosesUpInOrder) {
  constexpr uint8_t kGuard = 0xa5;
  for (const detail::ScanKind kind : compares_here()) {
    SCOPED_TRACE(detail::scan_name(kind));
    const UseCompare compare(kind);
    for (size_t elem : {1, 2, 4}) {
      for (bool xor_values : {false, true}) {
        // Every pattern among 8 elements (group g changes as the bits of g % 256) in blocks of
        // 8 Ki elements, rare changes between them (the scan's loop for those), and a tail.
        const size_t n = 18 * 1024 + 37;
        const auto changes = [](size_t e) {
          if (e >= 18 * 1024) return e % 3 == 0;
          if (e >= 8 * 1024 && e < 16 * 1024) return e % 101 == 0;
          return (e / 8 % 256 >> e % 8 & 1) != 0;
        };
        std::mt19937_64 rng(elem);
        Bytes before(n * elem), after;
        for (auto& b : before) b = static_cast<uint8_t>(rng());
        after = before;
        Bytes want_bitmap((n + 7) / 8, 0), want_values;
        for (size_t e = 0; e < n; ++e) {
          if (!changes(e)) continue;
          after[e * elem + rng() % elem] ^= static_cast<uint8_t>(1 + rng() % 255);
          want_bitmap[e / 8] |= static_cast<uint8_t>(1u << e % 8);
          for (size_t i = 0; i < elem; ++i) {
            want_values.push_back(xor_values ? after[e * elem + i] ^ before[e * elem + i] : after[e * elem + i]);
          }
        }
        Bytes bitmap((n + 63) / 64 * 8 + 16 + 64, kGuard), values(n * elem + 64, kGuard);
        const uint64_t k =
            detail::scan_parallel(before.data(), after.data(), n, elem, xor_values, bitmap.data(), values.data());
        ASSERT_EQ(k * elem, want_values.size()) << elem;
        EXPECT_TRUE(std::equal(want_values.begin(), want_values.end(), values.begin())) << elem << " " << xor_values;
        EXPECT_TRUE(std::equal(want_bitmap.begin(), want_bitmap.end(), bitmap.begin())) << elem;
        EXPECT_TRUE(std::all_of(values.begin() + static_cast<ptrdiff_t>(n * elem), values.end(),
                                [](uint8_t b) { return b == kGuard; }))
            << "a store past the values' room, " << elem << " bytes";
        EXPECT_TRUE(std::all_of(bitmap.begin() + static_cast<ptrdiff_t>((n + 63) / 64 * 8), bitmap.end(),
                                [](uint8_t b) { return b == kGuard; }))
            << "a store past the bitmap's room, " << elem << " bytes";
      }
    }
  }
}

// Every element changed: the values run level with the elements scanned, so a vector's store may
// reach no further than its own elements (a piece's last vector ends at the room's end); under every
// compare, for every width, lengths ending on and off a vector.
TEST(Delta, EveryElementChangedStoresNothingPastTheValuesRoom) {
  constexpr uint8_t kGuard = 0x3c;
  for (const detail::ScanKind kind : compares_here()) {
    SCOPED_TRACE(detail::scan_name(kind));
    const UseCompare compare(kind);
    for (size_t elem : {1, 2, 4}) {
      for (size_t n : {size_t{32}, size_t{40}, size_t{64 * 5 + 3}, size_t{4096 + 24}, size_t{40'003}}) {
        auto [before, after] = pair_with_changes(n, elem, n, n + elem);
        Bytes bitmap((n + 63) / 64 * 8 + 16, 0), values(n * elem + 64, kGuard);
        const uint64_t k =
            detail::scan_parallel(before.data(), after.data(), n, elem, false, bitmap.data(), values.data());
        ASSERT_EQ(k, n) << elem << " bytes, " << n;
        EXPECT_TRUE(std::equal(after.begin(), after.end(), values.begin())) << elem << " bytes, " << n;
        EXPECT_TRUE(std::all_of(values.begin() + static_cast<ptrdiff_t>(n * elem), values.end(),
                                [](uint8_t b) { return b == kGuard; }))
            << "a store past the values' room, " << elem << " bytes, " << n;
      }
    }
  }
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

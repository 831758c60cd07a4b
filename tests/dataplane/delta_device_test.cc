// The delta codec on a CUDA device (dataplane/delta_device.h), against plain loops written here: the
// compare's bitmap and changed values (or XORs) at every change rate and element width, with
// counts that end inside a bitmap byte and inside a block; the apply of a bitmap's marked
// elements in runs of every length, plain and XOR; the decode of runs encodings against the host's
// walk of them. Skips without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/device_copy.h"
#include "dataplane/delta.h"
#include "dataplane/delta_device.h"
#include "tests/dataplane/delta_device_util.h"

namespace ferry::dataplane {
namespace {

using device_testing::Bytes;
using device_testing::changed_at;
using device_testing::on_device;
using device_testing::random_bytes;
using device_testing::to_host;

TEST(DeltaOnDevice, TheCompareWritesEveryChangedElementInOrder) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  for (size_t elem : {1, 2, 4, 8}) {
    // 0, one element, a partial bitmap byte, a block and one more, several blocks ending mid-byte.
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{2049}, size_t{300'003}}) {
      for (double rate : {0.0, 0.001, 0.03, 1.0}) {
        for (bool xor_values : {false, true}) {
          Bytes before(n * elem), after;
          for (auto& b : before) b = static_cast<uint8_t>(rng());
          after = changed_at(before, n, elem, rate, rng, 0x80);
          // The reference: a loop over the elements.
          Bytes bitmap((n + 7) / 8, 0), values;
          for (size_t e = 0; e < n; ++e) {
            if (std::memcmp(&before[e * elem], &after[e * elem], elem) == 0) continue;
            bitmap[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
            for (size_t i = 0; i < elem; ++i) {
              values.push_back(xor_values ? after[e * elem + i] ^ before[e * elem + i] : after[e * elem + i]);
            }
          }
          Buffer b = on_device(before), a = on_device(after);
          auto map = Buffer::allocate(bitmap.size() + 1, Device::cuda(0));
          auto vals = Buffer::allocate(n * elem + 8, Device::cuda(0));
          ASSERT_TRUE(map.ok() && vals.ok());
          auto k = scan_changes_on_device(0, b.data(), a.data(), n, elem, xor_values, map->data(), vals->data());
          ASSERT_TRUE(k.ok()) << k.status().to_string();
          SCOPED_TRACE(testing::Message()
                       << "elem " << elem << " n " << n << " rate " << rate << " xor " << xor_values);
          EXPECT_EQ(*k, values.size() / elem);
          EXPECT_EQ(to_host(*map, bitmap.size()), bitmap);
          EXPECT_EQ(to_host(*vals, values.size()), values);
        }
      }
    }
  }
}

TEST(DeltaOnDevice, TheApplyWritesEveryMarkedElementAndNothingElse) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  for (size_t elem : {1, 2, 4, 8}) {
    for (size_t n : {size_t{1}, size_t{13}, size_t{2048}, size_t{100'003}}) {
      for (bool xor_values : {false, true}) {
        Bytes dst(n * elem);
        for (auto& b : dst) b = static_cast<uint8_t>(rng());
        // Runs of 1 to 5000 marked elements with gaps between them, and single ones.
        Bytes bitmap((n + 7) / 8, 0), values, want = dst;
        for (size_t e = rng() % 50; e < n;) {
          const size_t len = std::min<size_t>(n - e, 1 + (rng() % 4 == 0 ? rng() % 5000 : rng() % 3));
          for (size_t i = e; i < e + len; ++i) {
            bitmap[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
            for (size_t k = 0; k < elem; ++k) {
              const auto v = static_cast<uint8_t>(rng());
              values.push_back(v);
              want[i * elem + k] = xor_values ? static_cast<uint8_t>(want[i * elem + k] ^ v) : v;
            }
          }
          e += len + 1 + rng() % 300;
        }
        Buffer d = on_device(dst), m = on_device(bitmap), v = on_device(values);
        ASSERT_TRUE(apply_bitmap_on_device(0, d.data(), n, elem, m.data_as<uint8_t>(), v.data(), xor_values).ok());
        EXPECT_EQ(to_host(d, dst.size()), want) << "elem " << elem << " n " << n << " xor " << xor_values;
      }
    }
  }
}

// The receive end's whole path: encodings the host codec wrote (runs and bitmap, plain, XOR, zstd)
// applied in device memory give the new values; a bad one is refused and writes nothing.
TEST(DeltaOnDevice, EncodingsApplyInDeviceMemoryAsOnTheHost) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(17);
  Buffer upload;
  for (size_t elem : {1, 2, 4, 8}) {
    for (double rate : {0.0, 0.001, 0.03, 0.5}) {
      const size_t n = 70'001;
      Bytes before(n * elem);
      for (auto& b : before) b = static_cast<uint8_t>(rng());
      const Bytes after = changed_at(before, n, elem, rate, rng);
      for (int flags = 0; flags < 3; ++flags) {  // plain, XOR, XOR in a zstd frame
        Bytes enc;
        const DeltaChoice c = encode_delta(before.data(), after.data(), n, elem, true, enc, flags > 0);
        uint32_t field = static_cast<uint32_t>(c.encoding) | (flags > 0 ? kDeltaXor : 0u);
        if (flags == 2 && compress_delta(enc, 1)) field |= kDeltaZstd;
        Buffer d = on_device(before);
        const Status st =
            apply_delta_on_device(field, enc.data(), enc.size(), d.data(), Device::cuda(0), n, elem, upload);
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_EQ(to_host(d, after.size()), after)
            << "elem " << elem << " rate " << rate << " " << encoding_name(c.encoding) << " flags " << flags;
      }
    }
  }
  Buffer d = on_device(Bytes(200, 7));
  const Bytes junk = {5, 1, 1};
  EXPECT_EQ(apply_delta_on_device(static_cast<uint32_t>(DeltaEncoding::kRuns), junk.data(), junk.size(), d.data(),
                                  Device::cuda(0), 100, 2, upload)
                .code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(to_host(d, 200), Bytes(200, 7)) << "a refused delta wrote";
}

// The trainer's runs from its compare's bitmap, found on the device, against the pairs of varints a
// plain loop writes here: byte for byte, at every change rate, with runs that cross 64-element words
// and blocks of words, end at the last element or cover the piece; written only when they would be
// chosen (the count's varint and the pairs within the limit).
TEST(DeltaOnDevice, TheRunsOfACompareAreFoundOnTheDeviceAsTheFormatHasThem) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(41);
  Buffer pairs;
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{300'003}, size_t{2'000'001}}) {
    for (int pattern = 0; pattern < 7; ++pattern) {
      Bytes before(n), after(n);
      for (auto& b : before) b = static_cast<uint8_t>(rng());
      after = before;
      const double rates[] = {0.0, 0.001, 0.03, 0.5, 1.0};
      for (size_t e = 0; e < n; ++e) {
        bool change = false;
        if (pattern < 5) change = static_cast<double>(rng() % 1'000'000) < rates[pattern] * 1e6;
        if (pattern == 5) change = (e / 100) % 3 == 1 || e + 1 == n;  // runs of 100 across words, and the last
        if (pattern == 6) change = e % 64 == 63 || e % 64 == 0;       // runs of 2 across every word border
        if (change) after[e] ^= 0x5a;
      }
      // The reference: runs by a plain loop, then their pairs.
      Bytes want;
      uint64_t r = 0, at = 0;
      for (size_t e = 0; e < n;) {
        if (before[e] == after[e]) {
          ++e;
          continue;
        }
        size_t end = e;
        while (end < n && before[end] != after[end]) ++end;
        for (uint64_t v : {uint64_t{e - at}, uint64_t{end - e}}) {
          for (; v >= 0x80; v >>= 7) want.push_back(static_cast<uint8_t>(v | 0x80));
          want.push_back(static_cast<uint8_t>(v));
        }
        ++r;
        at = e = end;
      }
      Buffer b = on_device(before), a = on_device(after);
      auto scan = Buffer::allocate(round16((n + 7) / 8) + n + 64, Device::cuda(0));
      ASSERT_TRUE(scan.ok());
      auto* out = scan->data_as<uint8_t>();
      ASSERT_TRUE(scan_changes_on_device(0, b.data(), a.data(), n, 1, false, out, out + round16((n + 7) / 8)).ok());
      for (size_t limit : {want.size() + varint_bytes(r), want.size() + varint_bytes(r) - 1, (n + 7) / 8}) {
        auto found = runs_on_device(0, out, n, limit, pairs);
        ASSERT_TRUE(found.ok()) << found.status().to_string();
        EXPECT_EQ(found->runs, r) << "n " << n << " pattern " << pattern;
        // Runs too many even at two bytes a pair are not listed.
        const bool listed = varint_bytes(r) + 2 * r <= limit;
        EXPECT_EQ(found->pair_bytes, listed ? want.size() : 0) << "n " << n << " pattern " << pattern;
        EXPECT_EQ(found->written, varint_bytes(r) + want.size() <= limit) << "n " << n << " limit " << limit;
        if (found->written) {
          EXPECT_EQ(to_host(pairs, want.size()), want) << "n " << n << " pattern " << pattern;
        }
        if (limit != (n + 7) / 8) continue;
        // With the bitmap's size as the limit, as the trainer asks: the choice and bytes the host codec
        // makes of the same pair.
        Bytes enc;
        const DeltaChoice host = encode_delta(before.data(), after.data(), n, 1, /*prefer_delta=*/true, enc);
        const auto runs =
            found->written ? std::optional{std::pair<uint64_t, size_t>{r, found->pair_bytes}} : std::nullopt;
        ASSERT_EQ(choose_delta(host.changed, n, 1, true, runs), host.encoding) << "n " << n << " pattern " << pattern;
        if (host.encoding == DeltaEncoding::kRuns) {
          ASSERT_GE(enc.size(), varint_bytes(r) + want.size());
          EXPECT_EQ(Bytes(enc.begin() + static_cast<std::ptrdiff_t>(varint_bytes(r)),
                          enc.begin() + static_cast<std::ptrdiff_t>(varint_bytes(r) + want.size())),
                    to_host(pairs, want.size()));
        }
      }
    }
  }
}

// A runs encoding of `pairs` (skip, length) and `k` values of `elem` bytes from `rng`, each varint
// written in `pad` bytes at least (0x80 continuations past the value: as get_varint reads them).
Bytes runs_encoding(const std::vector<std::pair<uint64_t, uint64_t>>& pairs, size_t values, size_t elem,
                    std::mt19937_64& rng, size_t pad = 1) {
  Bytes out;
  const auto varint = [&](uint64_t v) {
    size_t written = 0;
    for (; v >= 0x80 || written + 1 < pad; v >>= 7, ++written) out.push_back(static_cast<uint8_t>((v & 0x7f) | 0x80));
    out.push_back(static_cast<uint8_t>(v));
  };
  varint(pairs.size());
  for (const auto& [skip, len] : pairs) varint(skip), varint(len);
  for (size_t i = 0; i < values * elem; ++i) out.push_back(static_cast<uint8_t>(rng()));
  return out;
}

// detail::apply_runs on an encoding's parts (as apply_delta_on_device uploads them), over `old`;
// the result, or the status when refused.
Status runs_on_device(const Bytes& enc, uint32_t flags, const Bytes& old, size_t n, size_t elem, Bytes* result) {
  DeltaRuns runs;
  FERRY_RETURN_IF_ERROR(
      delta_runs(static_cast<uint32_t>(DeltaEncoding::kRuns) | flags, enc.data(), enc.size(), n, elem, runs));
  Buffer d = on_device(old);
  Buffer pairs = on_device(Bytes(runs.pairs, runs.pairs + runs.pair_bytes));
  Buffer values = on_device(Bytes(runs.values, runs.values + runs.changed * elem));
  const Status st = detail::apply_runs(0, d.data(), n, elem, pairs.data_as<uint8_t>(), runs.pair_bytes, runs.runs,
                                       values.data(), runs.changed, runs.xor_values, nullptr);
  *result = to_host(d, old.size());
  return st;
}

// The device's decoder of runs against the host's walk (apply_delta) of the same bytes: varints of
// 1 to 10 bytes (padded ones too), runs that touch, cross 64-element words and blocks, or cover the
// piece, plain and XOR; and every encoding the host refuses refused here, with nothing written.
TEST(DeltaOnDevice, RunsAreDecodedOnTheDeviceAsTheHostWalksThem) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(29);
  const size_t n = 3'000'017;
  for (size_t elem : {1, 2, 4, 8}) {
    const Bytes old = random_bytes(n * elem, rng);
    struct Case {
      const char* what;
      std::vector<std::pair<uint64_t, uint64_t>> pairs;
      size_t pad = 1;
    };
    std::vector<Case> cases;
    {
      Case c{"scattered, skips and lengths of 1 to 3 bytes", {}};
      uint64_t at = 0;
      while (true) {
        const uint64_t skip = rng() % 4 == 0 ? rng() % 40'000 : rng() % 9;
        const uint64_t len = rng() % 8 == 0 ? 1 + rng() % 300 : 1 + rng() % 3;
        if (at + skip + len > n) break;
        c.pairs.emplace_back(skip, len);
        at += skip + len;
      }
      cases.push_back(c);
    }
    cases.push_back({"runs that touch (skip 0)", {{0, 1}, {0, 63}, {0, 1}, {0, 64}, {1, 1}, {0, 130}}});
    cases.push_back({"one run over the piece", {{0, n}}});
    cases.push_back({"varints padded to 10 bytes", {{5, 7}, {64, 1}, {1, 200}}, 10});
    cases.push_back({"the last element", {{n - 1, 1}}});
    for (const Case& c : cases) {
      uint64_t k = 0;
      for (const auto& pair : c.pairs) k += pair.second;
      const Bytes enc = runs_encoding(c.pairs, k, elem, rng, c.pad);
      for (uint32_t flags : {0u, kDeltaXor}) {
        Bytes want = old;
        ASSERT_TRUE(apply_delta(static_cast<uint32_t>(DeltaEncoding::kRuns) | flags, enc.data(), enc.size(),
                                want.data(), n, elem)
                        .ok())
            << c.what;
        Bytes got;
        const Status st = runs_on_device(enc, flags, old, n, elem, &got);
        ASSERT_TRUE(st.ok()) << c.what << " elem " << elem << ": " << st.to_string();
        EXPECT_TRUE(got == want) << c.what << " elem " << elem << " flags " << flags;
      }
    }
    {
      // A 10-byte varint whose last byte carries bits past 64: read as get_varint reads it (skip 1).
      Bytes enc = {1, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x7e, 2};
      for (size_t i = 0; i < 2 * elem; ++i) enc.push_back(static_cast<uint8_t>(0xa0 + i));
      Bytes want = old;
      ASSERT_TRUE(apply_delta(DeltaEncoding::kRuns, enc.data(), enc.size(), want.data(), n, elem).ok());
      ASSERT_NE(want, old);
      Bytes got;
      ASSERT_TRUE(runs_on_device(enc, 0, old, n, elem, &got).ok());
      EXPECT_TRUE(got == want) << "elem " << elem;
    }
    // Refused by the host's walk: refused by the device, nothing written.
    struct Bad {
      const char* what;
      Bytes enc;
    };
    std::vector<Bad> bad;
    bad.push_back({"a run of 0 elements", runs_encoding({{3, 2}, {4, 0}, {1, 1}}, 3, elem, rng)});
    bad.push_back({"a run longer than the piece", runs_encoding({{0, n + 1}}, n + 1, elem, rng)});
    bad.push_back({"runs that end past the piece", runs_encoding({{n - 2, 1}, {n - 2, 1}}, 2, elem, rng)});
    bad.push_back({"a value too many", runs_encoding({{3, 2}, {4, 1}}, 4, elem, rng)});
    bad.push_back({"a value too few", runs_encoding({{3, 2}, {4, 1}}, 2, elem, rng)});
    {
      Bytes b = {2, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 1, 4, 1};
      for (size_t i = 0; i < 2 * elem; ++i) b.push_back(1);
      bad.push_back({"a varint of 11 bytes", b});
    }
    for (const Bad& b : bad) {
      Bytes host = old;
      ASSERT_EQ(apply_delta(DeltaEncoding::kRuns, b.enc.data(), b.enc.size(), host.data(), n, elem).code(),
                StatusCode::kDataLoss)
          << b.what;
      Bytes got;
      const Status st = runs_on_device(b.enc, 0, old, n, elem, &got);
      EXPECT_EQ(st.code(), StatusCode::kDataLoss) << b.what << " elem " << elem << ": " << st.to_string();
      EXPECT_TRUE(got == old) << b.what << " wrote";
      // The whole path says why, as the host does.
      Buffer d = on_device(old);
      Buffer upload;
      const Status whole = apply_delta_on_device(static_cast<uint32_t>(DeltaEncoding::kRuns), b.enc.data(),
                                                 b.enc.size(), d.data(), Device::cuda(0), n, elem, upload);
      EXPECT_EQ(whole.code(), StatusCode::kDataLoss) << b.what;
      EXPECT_EQ(whole.message().find("on the device"), std::string::npos) << whole.to_string();
      EXPECT_TRUE(to_host(d, old.size()) == old) << b.what << " wrote";
    }
  }
}

// A runs encoding that lies in device memory (a device bucket's payload, at any offset) is applied
// there from its values' place as the sender gives it (apply_device_runs): the result is the
// host's walk of the same bytes. A place that is wrong by a byte, past the end or unsaid, and an
// encoding the host refuses, are refused with DataLoss and nothing written; a flagged encoding is
// not taken.
TEST(DeltaOnDevice, EncodingsInDeviceMemoryApplyThereFromTheirValuesPlace) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(31);
  const size_t n = 100'003;
  for (size_t elem : {1, 2, 4, 8}) {
    const Bytes old = random_bytes(n * elem, rng);
    for (double rate : {0.0, 0.001, 0.03}) {
      const Bytes now = changed_at(old, n, elem, rate, rng);
      Bytes enc;
      const DeltaChoice c = encode_delta(old.data(), now.data(), n, elem, /*prefer_delta=*/true, enc);
      ASSERT_EQ(c.encoding, DeltaEncoding::kRuns) << "elem " << elem << " rate " << rate;
      const uint64_t values_at = enc.size() - c.changed * elem;
      Bytes placed = {0xee, 0xee, 0xee};  // the encoding 3 bytes into the payload
      placed.insert(placed.end(), enc.begin(), enc.end());
      Buffer payload = on_device(placed);
      const uint8_t* at = payload.data_as<uint8_t>() + 3;
      Buffer d = on_device(old), upload;
      const auto runs = static_cast<uint32_t>(DeltaEncoding::kRuns);
      const Status st = apply_device_runs(runs, at, enc.size(), values_at, d.data(), Device::cuda(0), n, elem, upload);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(to_host(d, old.size()) == now) << "elem " << elem << " rate " << rate;
      if (c.changed == 0) continue;
      for (const uint64_t wrong : {values_at - 1, values_at + 1, uint64_t{enc.size()} + 1, uint64_t{0}}) {
        Buffer fresh = on_device(old);
        const Status refused =
            apply_device_runs(runs, at, enc.size(), wrong, fresh.data(), Device::cuda(0), n, elem, upload);
        EXPECT_EQ(refused.code(), StatusCode::kDataLoss) << "values at " << wrong << " of " << values_at;
        EXPECT_TRUE(to_host(fresh, old.size()) == old) << "values at " << wrong << " wrote";
      }
      Buffer fresh = on_device(old);
      EXPECT_EQ(
          apply_device_runs(runs | kDeltaXor, at, enc.size(), values_at, fresh.data(), Device::cuda(0), n, elem, upload)
              .code(),
          StatusCode::kInvalidArgument);
      // A byte that finishes no varint between the pairs and the values (0x80), its place past it:
      // the pairs' varints still number 2r, but the host refuses it, and so does the device.
      Bytes padded(enc.begin(), enc.begin() + static_cast<std::ptrdiff_t>(values_at));
      padded.push_back(0x80);
      padded.insert(padded.end(), enc.begin() + static_cast<std::ptrdiff_t>(values_at), enc.end());
      Bytes host_try = old;
      ASSERT_EQ(apply_delta(runs, padded.data(), padded.size(), host_try.data(), n, elem).code(),
                StatusCode::kDataLoss);
      Buffer padded_payload = on_device(padded);
      const Status unfinished = apply_device_runs(runs, padded_payload.data_as<uint8_t>(), padded.size(), values_at + 1,
                                                  fresh.data(), Device::cuda(0), n, elem, upload);
      EXPECT_EQ(unfinished.code(), StatusCode::kDataLoss) << unfinished.to_string();
      EXPECT_TRUE(to_host(fresh, old.size()) == old) << "pairs ending inside a varint wrote";
    }
    // No runs, then bytes (as pairs, or as a value): refused (as by the host), nothing written.
    {
      const Bytes extra = {0, 1, 1, 1, 1, 1, 1, 1, 1};
      Bytes host_try = old;
      ASSERT_EQ(
          apply_delta(static_cast<uint32_t>(DeltaEncoding::kRuns), extra.data(), extra.size(), host_try.data(), n, elem)
              .code(),
          StatusCode::kDataLoss);
      Buffer payload = on_device(extra), d = on_device(old), upload;
      for (const uint64_t place : {uint64_t{1}, uint64_t{extra.size() - elem}}) {
        const Status st = apply_device_runs(static_cast<uint32_t>(DeltaEncoding::kRuns), payload.data_as<uint8_t>(),
                                            extra.size(), place, d.data(), Device::cuda(0), n, elem, upload);
        EXPECT_EQ(st.code(), StatusCode::kDataLoss) << "values at " << place << ": " << st.to_string();
      }
      EXPECT_TRUE(to_host(d, old.size()) == old) << "no runs and bytes after them wrote";
    }
    // Refused by the host's walk (a run of 0 elements): refused here, nothing written.
    const Bytes bad = runs_encoding({{3, 2}, {4, 0}, {1, 1}}, 3, elem, rng);
    Buffer payload = on_device(bad), d = on_device(old), upload;
    const Status st = apply_device_runs(static_cast<uint32_t>(DeltaEncoding::kRuns), payload.data_as<uint8_t>(),
                                        bad.size(), bad.size() - 3 * elem, d.data(), Device::cuda(0), n, elem, upload);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
    EXPECT_TRUE(to_host(d, old.size()) == old) << "a refused encoding wrote";
  }
}

TEST(DeltaOnDevice, RefusesWidthsAndAlignmentsItCannotCompare) {
  SKIP_WITHOUT_GPU();
  auto b = Buffer::allocate(64, Device::cuda(0));
  ASSERT_TRUE(b.ok());
  auto* p = b->data_as<uint8_t>();
  EXPECT_EQ(scan_changes_on_device(0, p, p, 4, 3, false, p, p).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scan_changes_on_device(0, p + 1, p, 4, 2, false, p, p).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(apply_bitmap_on_device(0, p + 2, 4, 4, p, p, false).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::dataplane

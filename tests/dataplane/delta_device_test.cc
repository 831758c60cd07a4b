// The delta codec on a CUDA device (dataplane/delta_device.h), against plain loops written here: the
// compare's bitmap and changed values (or XORs) at every change rate and element width, with
// counts that end inside a bitmap byte and inside a block; the apply of a bitmap's marked
// elements in runs of every length, plain and XOR. Skips without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/device_copy.h"
#include "dataplane/delta.h"
#include "dataplane/delta_device.h"

namespace ferry::dataplane {
namespace {

using Bytes = std::vector<uint8_t>;

#define SKIP_WITHOUT_GPU() \
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device here"

Buffer on_device(const Bytes& b) {
  auto buf = Buffer::allocate(std::max<size_t>(b.size(), 1), Device::cuda(0));
  if (!buf.ok()) {
    ADD_FAILURE() << buf.status().to_string();
    return Buffer();
  }
  EXPECT_TRUE(copy_bytes(buf->data(), Device::cuda(0), b.data(), Device::cpu(), b.size()).ok());
  return std::move(*buf);
}

Bytes to_host(const Buffer& b, size_t bytes) {
  Bytes out(bytes);
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu(), b.data(), Device::cuda(0), bytes).ok());
  return out;
}

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
          after = before;
          for (size_t e = 0; e < n; ++e) {
            if (static_cast<double>(rng() % 1'000'000) < rate * 1e6) after[e * elem + rng() % elem] ^= 0x80;
          }
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
      Bytes after = before;
      for (size_t e = 0; e < n; ++e) {
        if (static_cast<double>(rng() % 1'000'000) < rate * 1e6) after[e * elem + rng() % elem] ^= 0x21;
      }
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

// The delta kernels on a CUDA device (kernels/delta.h), against plain loops written here: the
// compare's bitmap and changed values (or XORs) at every change rate and element width, with
// counts that end inside a bitmap byte and inside a block; the scatter of runs of every length,
// plain and XOR. Skips without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/device_copy.h"
#include "kernels/delta.h"

namespace ferry::kernels {
namespace {

using Bytes = std::vector<uint8_t>;

#define SKIP_WITHOUT_GPU() \
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device here"

Buffer on_device(const Bytes& b) {
  auto buf = Buffer::allocate(std::max<size_t>(b.size(), 1), Device::cuda(0));
  EXPECT_TRUE(buf.ok()) << buf.status().to_string();
  EXPECT_TRUE(copy_bytes(buf->data(), Device::cuda(0), b.data(), Device::cpu(), b.size()).ok());
  return std::move(*buf);
}

Bytes to_host(const Buffer& b, size_t bytes) {
  Bytes out(bytes);
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu(), b.data(), Device::cuda(0), bytes).ok());
  return out;
}

TEST(DeltaKernels, TheCompareWritesEveryChangedElementInOrder) {
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

TEST(DeltaKernels, TheScatterWritesEachChunkAndNothingElse) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  for (size_t elem : {1, 2, 4, 8}) {
    for (bool xor_values : {false, true}) {
      const size_t n = 100'000;
      Bytes dst(n * elem);
      for (auto& b : dst) b = static_cast<uint8_t>(rng());
      // Runs of 1 to 5000 elements with gaps between them, cut into chunks as a caller would.
      std::vector<DeltaChunk> chunks;
      Bytes values, want = dst;
      uint64_t at = 0, value = 0;
      while (true) {
        at += rng() % 300;
        const uint64_t len = 1 + (rng() % 4 == 0 ? rng() % 5000 : rng() % 3);
        if (at + len > n) break;
        for (uint64_t i = 0; i < len; i += kDeltaChunkElements) {
          chunks.push_back(
              {at + i, static_cast<uint32_t>(std::min<uint64_t>(len - i, kDeltaChunkElements)), value + i});
        }
        for (uint64_t e = at; e < at + len; ++e) {
          for (size_t i = 0; i < elem; ++i) {
            const auto v = static_cast<uint8_t>(rng());
            values.push_back(v);
            want[e * elem + i] = xor_values ? static_cast<uint8_t>(want[e * elem + i] ^ v) : v;
          }
        }
        value += len;
        at += len;
      }
      Buffer d = on_device(dst), v = on_device(values);
      Bytes raw(chunks.size() * sizeof(DeltaChunk));
      std::memcpy(raw.data(), chunks.data(), raw.size());
      Buffer c = on_device(raw);
      ASSERT_TRUE(scatter_delta_on_device(0, d.data(), elem, static_cast<const DeltaChunk*>(c.data()), chunks.size(),
                                          v.data(), xor_values)
                      .ok());
      EXPECT_EQ(to_host(d, dst.size()), want) << "elem " << elem << " xor " << xor_values;
    }
  }
}

TEST(DeltaKernels, RefusesWidthsAndAlignmentsItCannotCompare) {
  SKIP_WITHOUT_GPU();
  auto b = Buffer::allocate(64, Device::cuda(0));
  ASSERT_TRUE(b.ok());
  auto* p = b->data_as<uint8_t>();
  EXPECT_EQ(scan_changes_on_device(0, p, p, 4, 3, false, p, p).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scan_changes_on_device(0, p + 1, p, 4, 2, false, p, p).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scatter_delta_on_device(0, p + 2, 4, nullptr, 0, p, false).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::kernels

// Shared by the device codec's tests: host bytes onto the device and back, random bytes, and a
// change set of a given rate.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/device_copy.h"

#define SKIP_WITHOUT_GPU() \
  if (!::ferry::cuda_device_available()) GTEST_SKIP() << "no CUDA device here"

namespace ferry::dataplane::device_testing {

using Bytes = std::vector<uint8_t>;

inline Buffer on_device(const Bytes& b) {
  auto buf = Buffer::allocate(std::max<size_t>(b.size(), 1), Device::cuda(0));
  if (!buf.ok()) {
    ADD_FAILURE() << buf.status().to_string();
    return Buffer();
  }
  EXPECT_TRUE(copy_bytes(buf->data(), Device::cuda(0), b.data(), Device::cpu(), b.size()).ok());
  return std::move(*buf);
}

inline Bytes random_bytes(size_t size, std::mt19937_64& rng) {
  Bytes b(size);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// `old` (n elements of `elem` bytes) with about `rate` of its elements changed: one byte of each
// XORed with `flip`.
inline Bytes changed_at(const Bytes& old, size_t n, size_t elem, double rate, std::mt19937_64& rng,
                        uint8_t flip = 0x21) {
  Bytes now = old;
  for (size_t e = 0; e < n; ++e) {
    if (static_cast<double>(rng() % 1'000'000) < rate * 1e6) now[e * elem + rng() % elem] ^= flip;
  }
  return now;
}

inline Bytes to_host(const Buffer& b, size_t bytes) {
  Bytes out(bytes);
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu(), b.data(), Device::cuda(0), bytes).ok());
  return out;
}

}  // namespace ferry::dataplane::device_testing

// A random GPTQ act-order checkpoint and its reference kernel layout, computed independently.
#pragma once

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "tests/kernels/reference.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {

struct GptqCheckpoint {
  int64_t n = 0, k = 0;
  std::vector<int32_t> codes;  // [k][n], 0..15
  HostTensor qweight, scales, g_idx;
};

inline GptqCheckpoint make_gptq(int64_t n, int64_t k, uint64_t seed) {
  GptqCheckpoint c;
  c.n = n;
  c.k = k;
  std::mt19937_64 rng(seed);
  c.codes.resize(static_cast<size_t>(n * k));
  for (auto& v : c.codes) v = static_cast<int32_t>(rng() % 16);
  c.qweight = empty_like(DType::kI32, {k / 8, n});
  std::fill(c.qweight.bytes.begin(), c.qweight.bytes.end(), 0);
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t col = 0; col < n; ++col) {
      uint32_t w;
      std::memcpy(&w, &c.qweight.bytes[static_cast<size_t>(((kk / 8) * n + col) * 4)], 4);
      w |= static_cast<uint32_t>(c.codes[static_cast<size_t>(kk * n + col)]) << (4 * (kk % 8));
      std::memcpy(&c.qweight.bytes[static_cast<size_t>(((kk / 8) * n + col) * 4)], &w, 4);
    }
  }
  c.scales = empty_like(DType::kF16, {k / 128, n});
  for (int64_t i = 0; i < k / 128 * n; ++i) {
    const uint16_t h = testref::encode_f16(std::ldexp(1.0 + static_cast<double>(rng() % 1000) / 1000.0, -6));
    std::memcpy(&c.scales.bytes[static_cast<size_t>(i) * 2], &h, 2);
  }
  // Act-order: each group holds 128 rows scattered over k.
  std::vector<int32_t> g(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) g[static_cast<size_t>(i)] = static_cast<int32_t>(i / 128);
  std::shuffle(g.begin(), g.end(), rng);
  c.g_idx = empty_like(DType::kI32, {k});
  std::memcpy(c.g_idx.bytes.data(), g.data(), g.size() * 4);
  return c;
}

inline std::vector<int32_t> ref_perm(const GptqCheckpoint& c) {
  std::vector<int32_t> g(static_cast<size_t>(c.k));
  std::memcpy(g.data(), c.g_idx.bytes.data(), g.size() * 4);
  std::vector<int32_t> perm(static_cast<size_t>(c.k));
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) { return g[static_cast<size_t>(a)] < g[static_cast<size_t>(b)]; });
  return perm;
}

// Logical weight [n][k] in double: (code - 8) * scale[g_idx[k]].
inline std::vector<double> ref_gptq_weight(const GptqCheckpoint& c) {
  std::vector<double> w(static_cast<size_t>(c.n * c.k));
  for (int64_t col = 0; col < c.n; ++col) {
    for (int64_t kk = 0; kk < c.k; ++kk) {
      int32_t g;
      std::memcpy(&g, &c.g_idx.bytes[static_cast<size_t>(kk) * 4], 4);
      uint16_t h;
      std::memcpy(&h, &c.scales.bytes[static_cast<size_t>(g * c.n + col) * 2], 2);
      w[static_cast<size_t>(col * c.k + kk)] = (c.codes[static_cast<size_t>(kk * c.n + col)] - 8) * testref::decode_f16(h);
    }
  }
  return w;
}

}  // namespace ferry::kernels::testing

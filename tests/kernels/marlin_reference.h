// Marlin's layout as vLLM defines it, step by step (marlin_utils_test.py get_weight_perm /
// marlin_permute_weights / marlin_weights, marlin_utils.py get_scale_perms / marlin_permute_scales):
// lists built as vLLM builds them, the reshape and permute done on explicit index arrays, not
// ferry's closed-form positions (kernels/marlin_layout.h).
#pragma once

#include <cstdint>
#include <vector>

namespace ferry::kernels::testing {

// get_weight_perm(num_bits=4, is_a_8bit=False).
inline std::vector<int> vllm_weight_perm() {
  std::vector<int> perm;
  for (int i = 0; i < 32; ++i) {
    std::vector<int> perm1;
    const int col = i / 4;
    for (int block : {0, 1}) {
      for (int row : {2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1}) {
        perm1.push_back(16 * row + col + 8 * block);
      }
    }
    for (int j = 0; j < 4; ++j) {
      for (int p : perm1) perm.push_back(p + 256 * j);
    }
  }
  const int interleave[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  std::vector<int> out(perm.size());
  for (size_t a = 0; a < perm.size() / 8; ++a) {
    for (int b = 0; b < 8; ++b) out[8 * a + b] = perm[8 * a + interleave[b]];
  }
  return out;
}

// marlin_weights(q_w [K, N], ...): 16 x 16 tiles, the 1024-element permutation, 8 per int32.
inline std::vector<uint32_t> vllm_marlin_weights(const std::vector<uint32_t>& q, int64_t k, int64_t n) {
  // reshape (K/16, 16, N/16, 16), permute (0, 2, 1, 3), reshape (K/16, N*16)
  std::vector<uint32_t> t(q.size());
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    for (int64_t nt = 0; nt < n / 16; ++nt) {
      for (int64_t kk = 0; kk < 16; ++kk) {
        for (int64_t nn = 0; nn < 16; ++nn)
          t[kt * n * 16 + nt * 256 + kk * 16 + nn] = q[(kt * 16 + kk) * n + nt * 16 + nn];
      }
    }
  }
  // reshape (-1, 1024)[:, perm]
  const std::vector<int> perm = vllm_weight_perm();
  std::vector<uint32_t> u(t.size());
  for (size_t chunk = 0; chunk < t.size() / 1024; ++chunk) {
    for (size_t j = 0; j < 1024; ++j) u[chunk * 1024 + j] = t[chunk * 1024 + static_cast<size_t>(perm[j])];
  }
  // q_packed |= q_w[:, i::8] << 4 i
  std::vector<uint32_t> packed(u.size() / 8, 0);
  for (size_t w = 0; w < packed.size(); ++w) {
    for (int i = 0; i < 8; ++i) packed[w] |= u[8 * w + static_cast<size_t>(i)] << (4 * i);
  }
  return packed;
}

// marlin_permute_scales(s [groups, N], size_k, size_n, group_size=128).
inline std::vector<uint16_t> vllm_permute_scales(const std::vector<uint16_t>& s, int64_t k) {
  std::vector<int> scale_perm, scale_perm_single;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) scale_perm.push_back(i + 8 * j);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j : {0, 1, 8, 9, 16, 17, 24, 25}) scale_perm_single.push_back(2 * i + j);
  }
  const std::vector<int>& perm = 128 < k ? scale_perm : scale_perm_single;
  std::vector<uint16_t> out(s.size());
  for (size_t row = 0; row < s.size() / perm.size(); ++row) {
    for (size_t j = 0; j < perm.size(); ++j)
      out[row * perm.size() + j] = s[row * perm.size() + static_cast<size_t>(perm[j])];
  }
  return out;
}

}  // namespace ferry::kernels::testing

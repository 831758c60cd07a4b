// CPU gptq_int4 reload: derive perm, gather the codes into sorted order, copy scales, zero the
// workspace.
#include <cstring>
#include <vector>

#include "kernels/cpu_common.h"
#include "kernels/gptq.h"
#include "kernels/internal.h"

namespace ferry::kernels::detail::cpu {

Status gptq_reload(const detail::GptqArgs& a, int threads) {
  FERRY_ASSIGN_OR_RETURN(std::vector<int32_t> perm, detail::gptq_permutation(a.g_idx, a.k));
  if (a.marlin) return gptq_marlin(a, perm, threads);
  std::memcpy(a.perm, perm.data(), perm.size() * sizeof(int32_t));
  const int64_t n = a.n, words = a.k / kGptqPackFactor;
  detail::parallel_for(words, row_grain(n * kGptqPackFactor), threads, [&](int64_t b, int64_t e) {
    for (int64_t wi = b; wi < e; ++wi) {
      for (int64_t col = 0; col < n; ++col) {
        uint32_t word = 0;
        for (int64_t j = 0; j < kGptqPackFactor; ++j) {
          const int64_t src_k = perm[static_cast<size_t>(wi * kGptqPackFactor + j)];
          const uint32_t src = static_cast<uint32_t>(a.qweight[(src_k / kGptqPackFactor) * n + col]);
          const uint32_t code = (src >> (4 * (src_k % kGptqPackFactor))) & 0xFu;
          word |= code << (4 * j);
        }
        a.out_qweight[wi * n + col] = static_cast<int32_t>(word);
      }
    }
  });
  std::memcpy(a.out_scales, a.scales, static_cast<size_t>(a.k / kGroupSize * n) * sizeof(uint16_t));
  std::memset(a.workspace, 0, static_cast<size_t>(a.workspace_len) * sizeof(int32_t));
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

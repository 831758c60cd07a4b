// CPU dequantize: every stored element back to f32, in the parameter's logical order.
#include <vector>

#include "kernels/cpu_common.h"
#include "kernels/internal.h"
#include "kernels/weight_ops.h"

namespace ferry::kernels::detail::cpu {

Status dequantize(const detail::WeightArgs& a, float* out, int threads) {
  const detail::WeightRef w = detail::make_weight_ref(a);
  const int64_t cols = a.cols;
  if (a.scheme == Scheme::kGptqInt4) {
    // Undo the act-order permutation: sorted row k' is logical input row perm[k'].
    detail::parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        for (int64_t k = 0; k < cols; ++k) out[n * cols + a.perm[k]] = detail::weight_at(w, n, k);
      }
    });
    return ok_status();
  }
  detail::parallel_for(a.rows, row_grain(cols), threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = detail::weight_at(w, r, c);
    }
  });
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

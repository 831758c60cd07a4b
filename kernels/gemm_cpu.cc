// CPU reference GEMM y = x * W^T: one dequantized weight row at a time, summed in f32 over k in
// increasing (for gptq_int4: sorted) order.
#include <vector>

#include "kernels/cpu_common.h"
#include "kernels/internal.h"
#include "kernels/weight_ops.h"

namespace ferry::kernels::detail::cpu {

Status gemm(const detail::GemmArgs& a, int threads) {
  const detail::WeightRef w = detail::make_weight_ref(a.w);
  const int64_t n_out = a.w.rows, k_in = a.w.cols, m_rows = a.m;
  // x as f32, with columns already gathered through perm for gptq_int4.
  std::vector<float> xf(static_cast<size_t>(m_rows * k_in));
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t k = 0; k < k_in; ++k) {
      const int64_t src = m * k_in + (a.w.perm ? a.w.perm[k] : k);
      xf[static_cast<size_t>(m * k_in + k)] = a.x_dtype == DType::kBF16
                                                  ? bf16_to_f32(static_cast<const uint16_t*>(a.x)[src])
                                                  : static_cast<const float*>(a.x)[src];
    }
  }
  detail::parallel_for(n_out, row_grain(k_in * std::max<int64_t>(m_rows, 1)), threads, [&](int64_t b, int64_t e) {
    std::vector<float> wrow(static_cast<size_t>(k_in));
    for (int64_t n = b; n < e; ++n) {
      for (int64_t k = 0; k < k_in; ++k) wrow[static_cast<size_t>(k)] = detail::weight_at(w, n, k);
      for (int64_t m = 0; m < m_rows; ++m) {
        float acc = 0.0f;
        const float* xr = xf.data() + m * k_in;
        for (int64_t k = 0; k < k_in; ++k) acc += xr[k] * wrow[static_cast<size_t>(k)];
        a.y[m * n_out + n] = acc;
      }
    }
  });
  return ok_status();
}

}  // namespace ferry::kernels::detail::cpu

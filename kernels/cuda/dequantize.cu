// CUDA dequantize: one thread per element through weight_at(), the code the CPU runs too.
#include "kernels/cuda/common.cuh"
#include "kernels/internal.h"
#include "kernels/weight_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

__global__ void dequantize_kernel(WeightRef w, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= w.rows * w.cols) return;
  const int64_t r = i / w.cols, c = i % w.cols;
  const float v = weight_at(w, r, c);
  // gptq_int4: sorted input row c is logical row perm[c].
  out[w.perm ? r * w.cols + w.perm[c] : i] = v;
}

}  // namespace

Status dequantize(const WeightArgs& a, float* out, void* stream) {
  const int64_t n = a.rows * a.cols;
  if (n == 0) return ok_status();
  const WeightRef w = make_weight_ref(a);
  dequantize_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, as_stream(stream)>>>(w, out);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

}  // namespace ferry::kernels::detail::cuda

// The CUDA back end of a build without CUDA: every call on device views is Unavailable.
#include "kernels/internal.h"

namespace ferry::kernels::detail::cuda {
namespace {
Status unavailable() {
  return Status::unavailable("kernels: tensors are on a CUDA device but ferry was built without CUDA");
}
}  // namespace

Status quantize(const QuantArgs&, void*) { return unavailable(); }
Status dequantize(const WeightArgs&, float*, void*) { return unavailable(); }
Status gemm(const GemmArgs&, void*) { return unavailable(); }
Status gemm_check(const int32_t*, int64_t, void*) { return unavailable(); }
Status gptq_reload(const GptqArgs&, void*) { return unavailable(); }
Status marlin_quantize(const MarlinArgs&, void*) { return unavailable(); }
uint64_t fused_per_tensor_launches() { return 0; }
int64_t fused_per_tensor_min_bytes() { return 0; }

}  // namespace ferry::kernels::detail::cuda

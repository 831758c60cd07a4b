// CUDA gptq_int4 reload. The permutation is derived on the host from a copy of g_idx (K integers;
// the check that every group holds 128 rows needs a Status anyway), then the repack runs on the
// device.
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/gptq.h"
#include "kernels/internal.h"

namespace ferry::kernels::detail::cuda {
namespace {

// One thread per output word: gathers the 8 codes of sorted rows 8*wi .. 8*wi+7.
__global__ void repack_kernel(const int32_t* qweight, const int32_t* perm, int32_t* out, int64_t words, int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= words * n) return;
  const int64_t wi = t / n, col = t % n;
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < kGptqPackFactor; ++j) {
    const int64_t src_k = perm[wi * kGptqPackFactor + j];
    const uint32_t src = static_cast<uint32_t>(qweight[(src_k / kGptqPackFactor) * n + col]);
    word |= ((src >> (4 * (src_k % kGptqPackFactor))) & 0xFu) << (4 * j);
  }
  out[t] = static_cast<int32_t>(word);
}

}  // namespace

Status gptq_reload(const GptqArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  std::vector<int32_t> g_idx(static_cast<size_t>(a.k));
  FERRY_CUDA_CHECK(cudaMemcpyAsync(g_idx.data(), a.g_idx, g_idx.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  FERRY_ASSIGN_OR_RETURN(std::vector<int32_t> perm, gptq_permutation(g_idx.data(), a.k));
  FERRY_CUDA_CHECK(cudaMemcpyAsync(a.perm, perm.data(), perm.size() * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  if (a.marlin) {
    FERRY_RETURN_IF_ERROR(gptq_marlin(a, stream));
    FERRY_CUDA_CHECK(cudaStreamSynchronize(st));  // `perm` is read by the copy above
    return ok_status();
  }
  const int64_t words = a.k / kGptqPackFactor, total = words * a.n;
  repack_kernel<<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, st>>>(a.qweight, a.perm,
                                                                                               a.out_qweight, words, a.n);
  FERRY_CUDA_LAUNCH_CHECK();
  FERRY_CUDA_CHECK(cudaMemcpyAsync(a.out_scales, a.scales,
                                   static_cast<size_t>(a.k / kGroupSize * a.n) * sizeof(uint16_t),
                                   cudaMemcpyDeviceToDevice, st));
  FERRY_CUDA_CHECK(cudaMemsetAsync(a.workspace, 0, static_cast<size_t>(a.workspace_len) * sizeof(int32_t), st));
  // `perm` is pageable host memory that the copy reads; wait before it goes out of scope.
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  return ok_status();
}

}  // namespace ferry::kernels::detail::cuda

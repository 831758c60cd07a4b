// CUDA reference GEMMs y = x * W^T. gptq_int4 splits K into slices run by different blocks that take
// turns through the per-tile counters of the registered workspace, the way Marlin's reduction does.
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/weight_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

inline constexpr int kMaxKSlices = 4;
// How long a slice waits for its turn. Honest waits last as long as the previous slice's work.
inline constexpr uint64_t kTurnTimeoutNs = 2'000'000'000ull;

__device__ __forceinline__ float load_x(const void* x, DType dt, int64_t i) {
  return dt == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread per output element.
__global__ void gemm_kernel(WeightRef w, const void* x, DType x_dtype, int64_t m_rows, float* y) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t m = blockIdx.y;
  if (n >= w.rows || m >= m_rows) return;
  float acc = 0.0f;
  for (int64_t k = 0; k < w.cols; ++k) acc += load_x(x, x_dtype, m * w.cols + k) * weight_at(w, n, k);
  y[m * w.rows + n] = acc;
}

// Block (slice, tile): columns tile*64 .. +63, sorted input rows of K-slice `slice`. The slice
// waits until workspace[tile] == slice, adds its partial sums into y (slice 0 overwrites), then
// passes the turn on; the last slice sets the counter back to 0 for the next call.
__global__ void __launch_bounds__(kGptqTileN) gptq_gemm_kernel(WeightRef w, const void* x, DType x_dtype,
                                                               int64_t m_rows, float* y, int32_t* workspace) {
  const int slice = blockIdx.x, slices = gridDim.x;
  const int64_t tile = blockIdx.y;
  const int64_t n = tile * kGptqTileN + threadIdx.x;
  const int64_t groups = w.cols / kGroupSize;
  const int64_t k0 = groups * slice / slices * kGroupSize;
  const int64_t k1 = groups * (slice + 1) / slices * kGroupSize;
  __shared__ int my_turn;
  if (threadIdx.x == 0) {
    volatile int32_t* counter = workspace + tile;
    const uint64_t start = global_ns();
    int ok = 1;
    while (*counter != slice) {
      if (global_ns() - start > kTurnTimeoutNs) {
        ok = 0;
        atomicExch(workspace + gridDim.y, 1);  // the error flag follows the tiles' counters
        break;
      }
      __nanosleep(256);
    }
    __threadfence();
    my_turn = ok;
  }
  __syncthreads();
  if (!my_turn) return;
  if (n < w.rows) {
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k1; ++k) acc += load_x(x, x_dtype, m * w.cols + w.perm[k]) * weight_at(w, n, k);
      float* out = y + m * w.rows + n;
      *out = slice == 0 ? acc : *out + acc;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(workspace + tile, slice + 1 == slices ? 0 : slice + 1);
}

Status gptq_gemm(const GemmArgs& a, cudaStream_t st) {
  const WeightRef w = make_weight_ref(a.w);
  const int64_t tiles = (a.w.rows + kGptqTileN - 1) / kGptqTileN;
  const int64_t groups = a.w.cols / kGroupSize;
  const int slices = static_cast<int>(std::min<int64_t>(kMaxKSlices, groups));
  if (a.w.workspace_len != tiles + 1) {
    return Status::invalid_argument("gptq_int4 gemm: the workspace must hold ceil(N/64) + 1 integers");
  }
  if (a.m > 0 && tiles > 0) {
    gptq_gemm_kernel<<<dim3(static_cast<unsigned>(slices), static_cast<unsigned>(tiles)), kGptqTileN, 0, st>>>(
        w, a.x, a.x_dtype, a.m, a.y, a.w.workspace);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  return ok_status();
}

}  // namespace

Status gemm(const GemmArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  if (a.w.scheme == Scheme::kGptqInt4) return gptq_gemm(a, st);
  if (a.m > 0 && a.w.rows > 0) {
    const WeightRef w = make_weight_ref(a.w);
    const dim3 grid(static_cast<unsigned>((a.w.rows + kThreads - 1) / kThreads), static_cast<unsigned>(a.m));
    gemm_kernel<<<grid, kThreads, 0, st>>>(w, a.x, a.x_dtype, a.m, a.y);
    FERRY_CUDA_LAUNCH_CHECK();
  }
  return ok_status();
}

Status gemm_check(const int32_t* workspace, int64_t len, void* stream) {
  const cudaStream_t st = as_stream(stream);
  std::vector<int32_t> ws(static_cast<size_t>(len));
  if (len > 0) {
    FERRY_CUDA_CHECK(cudaMemcpyAsync(ws.data(), workspace, ws.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
  }
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  if (len == 0) return ok_status();
  const bool gave_up = ws.back() != 0;
  bool stale = false;
  for (size_t i = 0; i + 1 < ws.size(); ++i) stale = stale || ws[i] != 0;
  if (gave_up || stale) {
    return Status::failed_precondition(
        "gptq_int4 gemm: the workspace counters were not zero on entry (a stale workspace): K-slices ran out of "
        "turn and y is wrong; the workspace must be zeroed (gptq_reload does) before the kernel runs");
  }
  return ok_status();
}

}  // namespace ferry::kernels::detail::cuda

#include "bench/colocated_weights.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "core/float_convert.h"
#include "sharding/planner.h"

namespace ferry::bench {

#define CHECK_CUDA(expr)                                                                     \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) return Status::internal(fmt::format("{}: {}", #expr, cudaGetErrorString(e_))); \
  } while (0)

Result<double> copy_bandwidth(int device) {
  const size_t n = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaSetDevice(device));
  CHECK_CUDA(cudaMalloc(&a, n));
  CHECK_CUDA(cudaMalloc(&b, n));
  CHECK_CUDA(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> s;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(e0);
    cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) s.push_back(ms / 1e3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  std::sort(s.begin(), s.end());
  return 2.0 * static_cast<double>(n) / s[s.size() / 2];
}

Result<Weights> allocate_weights(const sharding::Manifest& manifest, Device device, const sharding::SenderInfo* held) {
  Weights w;
  const size_t pool_elems = size_t{256} << 20;  // 512 MiB of bf16
  std::vector<uint16_t> host(pool_elems);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& v : host) v = f32_to_bf16(dist(rng));
  FERRY_ASSIGN_OR_RETURN(w.pool, Buffer::allocate(pool_elems * 2, device));
  CHECK_CUDA(cudaMemcpy(w.pool.data(), host.data(), pool_elems * 2, cudaMemcpyHostToDevice));
  for (size_t i = 0; i < manifest.size(); ++i) {
    const auto& t = manifest[i];
    const Shape shape = held ? Shape(held->holds[i].region.size) : t.shape;
    const size_t bytes = std::max<size_t>(dtype_bytes(t.dtype, shape_numel(shape)), 1);
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(bytes, device));
    w.views.emplace(t.name, TensorView(b.data(), t.dtype, shape, device));
    w.params += static_cast<uint64_t>(shape_numel(shape));
    w.buffers.push_back(std::move(b));
  }
  return w;
}

Status change_weights(Weights& w, uint64_t step) {
  const size_t pool = w.pool.size();
  size_t at = (step * 2654435761ull) % (pool / 2) & ~size_t{255};
  for (auto& [name, v] : w.views) {
    size_t done = 0;
    const size_t n = v.nbytes();
    while (done < n) {
      const size_t len = std::min(n - done, pool - at);
      CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(v.data()) + done, w.pool.data_as<char>() + at, len,
                                 cudaMemcpyDeviceToDevice));
      done += len;
      at = (at + len + 4096) % (pool / 2);
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return ok_status();
}

}  // namespace ferry::bench

// Device and pinned allocators over the CUDA runtime (built only when CUDA is found).
#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/cuda_check.h"
#include "core/log.h"

namespace ferry {
namespace {

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  Result<void*> allocate(size_t bytes) override {
    if (bytes == 0) return static_cast<void*>(nullptr);
    FERRY_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    FERRY_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }
  void deallocate(void* ptr, size_t) override {
    if (cudaFree(ptr) != cudaSuccess) FERRY_LOG_WARN("cudaFree failed on device {}", device_);
  }
  Device device() const override { return Device::cuda(device_); }
  Status zero(void* ptr, size_t bytes) override {
    if (bytes == 0) return ok_status();
    FERRY_CUDA_CHECK(cudaSetDevice(device_));
    FERRY_CUDA_CHECK(cudaMemset(ptr, 0, bytes));
    return ok_status();
  }

 private:
  int device_;
};

class PinnedAllocator final : public Allocator {
 public:
  Result<void*> allocate(size_t bytes) override {
    if (bytes == 0) return static_cast<void*>(nullptr);
    void* p = nullptr;
    FERRY_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    return p;
  }
  void deallocate(void* ptr, size_t) override {
    if (cudaFreeHost(ptr) != cudaSuccess) FERRY_LOG_WARN("cudaFreeHost failed");
  }
  Device device() const override { return Device::cpu(); }
  Status zero(void* ptr, size_t bytes) override {
    if (bytes) std::memset(ptr, 0, bytes);
    return ok_status();
  }
};

constexpr int kMaxDevices = 64;

}  // namespace

bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

Result<Allocator*> cuda_allocator(int device_index) {
  int n = 0;
  FERRY_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device_index < 0 || device_index >= n || device_index >= kMaxDevices) {
    return Status::invalid_argument(fmt::format("cuda:{} does not exist ({} devices visible)", device_index, n));
  }
  static std::array<std::unique_ptr<CudaAllocator>, kMaxDevices> allocators;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = allocators[static_cast<size_t>(device_index)];
  if (!slot) slot = std::make_unique<CudaAllocator>(device_index);
  return static_cast<Allocator*>(slot.get());
}

Result<Allocator*> pinned_allocator() {
  if (!cuda_device_available()) return Status::unavailable("pinned memory needs a CUDA device");
  static PinnedAllocator allocator;
  return static_cast<Allocator*>(&allocator);
}

}  // namespace ferry

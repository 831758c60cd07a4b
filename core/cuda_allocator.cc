// Device and pinned allocators, and the private copy streams of core/device_copy.h, over the CUDA
// runtime (built only when CUDA is found).
#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/cuda_check.h"
#include "core/device_copy.h"
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

// core/device_copy.h
namespace ferry {
namespace {

struct CopyStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
};

// This thread's copy stream per device, created on first use and destroyed with the thread.
struct CopyStreams {
  std::array<CopyStream, kMaxDevices> per_device{};
  ~CopyStreams() {
    for (size_t i = 0; i < per_device.size(); ++i) {
      if (per_device[i].stream == nullptr) continue;
      cudaStreamDestroy(per_device[i].stream);
      cudaEventDestroy(per_device[i].event);
    }
  }
};

// The stream and event are created with their device current; using them later needs no current
// device (explicit streams), except where the legacy default stream is meant (ScopedDevice there).
Result<CopyStream> copy_stream(int device) {
  if (device < 0 || device >= kMaxDevices) return Status::invalid_argument(fmt::format("device copy on cuda:{}", device));
  thread_local CopyStreams streams;
  CopyStream& s = streams.per_device[static_cast<size_t>(device)];
  if (s.stream == nullptr) {
    ScopedDevice scope(device);
    if (!scope.ok()) return Status::invalid_argument(fmt::format("device copy: cannot use cuda:{}", device));
    FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming));
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  }
  return s;
}

}  // namespace

Status set_current_device(Device device) {
  if (device.is_cuda()) FERRY_CUDA_CHECK(cudaSetDevice(device.index));
  return ok_status();
}

Status copy_rows_async(int device, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       size_t rows) {
  if (rows == 0 || row_bytes == 0) return ok_status();
  FERRY_ASSIGN_OR_RETURN(CopyStream s, copy_stream(device));
  if (rows == 1) {
    FERRY_CUDA_CHECK(cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyDefault, s.stream));
  } else {
    FERRY_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, s.stream));
  }
  return ok_status();
}

Status wait_copies(int device) {
  FERRY_ASSIGN_OR_RETURN(CopyStream s, copy_stream(device));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  return ok_status();
}

Status copy_now(int device, void* dst, const void* src, size_t bytes) {
  FERRY_RETURN_IF_ERROR(copy_async(device, dst, src, bytes));
  return wait_copies(device);
}

Status order_copies_before_default(int device) {
  FERRY_ASSIGN_OR_RETURN(CopyStream s, copy_stream(device));
  ScopedDevice scope(device);  // the legacy default stream of `device`
  FERRY_CUDA_CHECK(cudaEventRecord(s.event, s.stream));
  FERRY_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamLegacy, s.event, 0));
  return ok_status();
}

Status order_default_before_copies(int device) {
  FERRY_ASSIGN_OR_RETURN(CopyStream s, copy_stream(device));
  ScopedDevice scope(device);  // the legacy default stream of `device`
  FERRY_CUDA_CHECK(cudaEventRecord(s.event, cudaStreamLegacy));
  FERRY_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.event, 0));
  return ok_status();
}

}  // namespace ferry

// Device helpers both device transports (cuda_ipc, nccl) use: polling an event, naming a device,
// finding a pointer's device, and the MemoryRegion of device memory they register.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "core/cuda_check.h"
#include "core/status.h"
#include "transport/transport.h"

namespace ferry::transport::gpu {

// cudaSuccess: done; cudaErrorNotReady: not yet; anything else is an error Status.
inline Result<bool> event_done(cudaEvent_t e, const char* what) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) return false;
  return cuda_status(r, what, __FILE__, __LINE__);
}

inline std::string bus_id(int device) {
  char buf[32] = {};
  if (cudaDeviceGetPCIBusId(buf, sizeof buf, device) != cudaSuccess) return "?";
  return buf;
}

// The CUDA device `ptr` lives on; InvalidArgument for host or unknown memory.
inline Result<int> device_of(const void* ptr) {
  cudaPointerAttributes a{};
  FERRY_RETURN_IF_ERROR(cuda_status(cudaPointerGetAttributes(&a, ptr), "cudaPointerGetAttributes", __FILE__, __LINE__));
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument("memory is not CUDA device memory");
  }
  return a.device;
}

// Device memory registered with a device transport.
class DeviceRegion final : public MemoryRegion {
 public:
  DeviceRegion(void* data, size_t size, int device) : data_(data), size_(size), device_(device) {}
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }

 private:
  void* data_;
  size_t size_;
  int device_;
};

}  // namespace ferry::transport::gpu

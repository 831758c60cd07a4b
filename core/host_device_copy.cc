// Whole host/device byte copies and device waits (core/device_copy.h), with or without CUDA.
#include <cstring>

#include "core/device_copy.h"
#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace ferry {

Status copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return ok_status();
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return ok_status();
  }
#if FERRY_HAVE_CUDA
  FERRY_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  // cudaMemcpy into device memory may return before the bytes land (from pageable host memory once
  // they are staged for the DMA; device to device at once), ordered only before later work on the
  // legacy default stream. Callers read them from other streams (the engine's process streams) and
  // other processes (a colocated rank reading a trainer's weights), so the copy is complete here.
  if (!dst_device.is_cpu()) FERRY_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return ok_status();
#else
  return Status::unavailable("copy to or from a CUDA device: ferry was built without CUDA");
#endif
}

Status device_synchronize(Device device) {
  if (device.is_cpu()) return ok_status();
#if FERRY_HAVE_CUDA
  FERRY_CUDA_CHECK(cudaSetDevice(device.index));
  FERRY_CUDA_CHECK(cudaDeviceSynchronize());
  return ok_status();
#else
  return Status::unavailable("CUDA device: ferry was built without CUDA");
#endif
}

}  // namespace ferry

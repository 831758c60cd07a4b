// FERRY_CUDA_CHECK: turns a cudaError_t into a Status carrying file:line. Include only from CUDA-enabled files.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/status.h"

namespace ferry {

inline Status cuda_status(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return ok_status();
  const StatusCode code = (err == cudaErrorMemoryAllocation) ? StatusCode::kResourceExhausted
                          : (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
                              ? StatusCode::kUnavailable
                              : StatusCode::kInternal;
  return Status(code, std::string(expr) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                          ") at " + file + ":" + std::to_string(line));
}

// Makes `device` current for a scope and puts the caller's device back after it, so that ferry never
// changes which device an application's thread works on.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&old_) != cudaSuccess) old_ = -1;
    ok_ = old_ == device || cudaSetDevice(device) == cudaSuccess;
  }
  ~ScopedDevice() {
    if (old_ >= 0) cudaSetDevice(old_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  // False when `device` could not be made current.
  bool ok() const { return ok_; }

 private:
  int old_ = -1;
  bool ok_ = false;
};

}  // namespace ferry

#define FERRY_CUDA_CHECK(expr) FERRY_RETURN_IF_ERROR(::ferry::cuda_status((expr), #expr, __FILE__, __LINE__))

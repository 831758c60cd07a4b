// Buffer: owned memory on a device, from an Allocator. Move-only; frees on destruction.
#pragma once

#include <cstddef>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Result<void*> allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  virtual Device device() const = 0;
  // Zero `bytes` at `ptr` (memset on the host, cudaMemset on a device).
  virtual Status zero(void* ptr, size_t bytes) = 0;
};

// 64-byte aligned host memory (4 KiB aligned from 1 MiB up).
Allocator& cpu_allocator();
// Device memory on `device_index`; Unavailable when ferry was built without CUDA or no device is present.
Result<Allocator*> cuda_allocator(int device_index);
// Page-locked host memory for device staging; Unavailable without CUDA.
Result<Allocator*> pinned_allocator();
// True when built with CUDA and at least one device is visible.
bool cuda_device_available();

class Buffer {
 public:
  Buffer() = default;
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  static Result<Buffer> allocate(size_t bytes, Allocator& allocator);
  static Result<Buffer> allocate(size_t bytes, Device device = Device::cpu());

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }
  Device device() const;
  Status zero();
  // A contiguous view of the start of the buffer as dtype[shape]; the shape must fit.
  Result<TensorView> view(DType dtype, Shape shape) const;
  void reset();

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  Allocator* allocator_ = nullptr;
};

}  // namespace ferry

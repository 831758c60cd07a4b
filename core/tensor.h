// TensorView: a non-owning view of typed memory on a device, and Region: a box inside a tensor.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/dims.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int i) { return {DeviceType::kCUDA, i}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string to_string() const;
};

// "cpu" or "cuda:N" (what Device::to_string() writes); InvalidArgument naming `text` otherwise.
Result<Device> parse_device(std::string_view text);

using Shape = std::vector<int64_t>;

int64_t shape_numel(std::span<const int64_t> shape);
std::string shape_to_string(std::span<const int64_t> shape);
// Row-major strides, in elements.
Shape contiguous_strides(const Shape& shape);

class TensorView {
 public:
  TensorView() = default;
  // A contiguous view.
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu());
  TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  Device device() const { return device_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int64_t numel() const { return shape_numel(shape_); }
  // Bytes of the elements, as if contiguous.
  size_t nbytes() const { return dtype_bytes(dtype_, numel()); }
  bool is_contiguous() const;
  bool empty() const { return data_ == nullptr; }

  // rows x cols view of a tensor of rank >= 1: rows = dim(0), cols = product of the rest
  // (1 for a vector).
  int64_t rows() const;
  int64_t cols() const;

  std::string describe() const;  // "bf16[4096, 4096] cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Shape strides_;
  Device device_;
};

// A box inside a tensor: offset and size per dimension.
struct Region {
  Dims offset;
  Dims size;

  static Region whole(const Shape& shape);
  int rank() const { return static_cast<int>(size.size()); }
  int64_t numel() const { return shape_numel(size); }
  bool overlaps(const Region& other) const;
  // True when the box lies inside a tensor of `shape`.
  bool inside(const Dims& shape) const;
  bool operator==(const Region&) const = default;
  std::string to_string() const;  // "[0:128, 64:96]"
};

// Checks that `view` is contiguous, has `dtype` and `shape`, naming `what` in the error.
Status expect_tensor(const TensorView& view, std::string_view what, DType dtype, const Shape& shape);

}  // namespace ferry

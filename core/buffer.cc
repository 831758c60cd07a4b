#include "core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include <fmt/format.h>

namespace ferry {
namespace {

class CpuAllocator final : public Allocator {
 public:
  Result<void*> allocate(size_t bytes) override {
    if (bytes == 0) return static_cast<void*>(nullptr);
    const size_t align = bytes >= (1u << 20) ? 4096 : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) return Status::resource_exhausted(fmt::format("host allocation of {} bytes failed", bytes));
    return p;
  }
  void deallocate(void* ptr, size_t) override { std::free(ptr); }
  Device device() const override { return Device::cpu(); }
  Status zero(void* ptr, size_t bytes) override {
    if (bytes) std::memset(ptr, 0, bytes);
    return ok_status();
  }
};

}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator allocator;
  return allocator;
}

Buffer::~Buffer() { reset(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      allocator_(std::exchange(other.allocator_, nullptr)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    allocator_ = std::exchange(other.allocator_, nullptr);
  }
  return *this;
}

void Buffer::reset() {
  if (data_ != nullptr && allocator_ != nullptr) allocator_->deallocate(data_, size_);
  data_ = nullptr;
  size_ = 0;
  allocator_ = nullptr;
}

Result<Buffer> Buffer::allocate(size_t bytes, Allocator& allocator) {
  Buffer b;
  FERRY_ASSIGN_OR_RETURN(b.data_, allocator.allocate(bytes));
  b.size_ = bytes;
  b.allocator_ = &allocator;
  return b;
}

Result<Buffer> Buffer::allocate(size_t bytes, Device device) {
  if (device.is_cpu()) return allocate(bytes, cpu_allocator());
  FERRY_ASSIGN_OR_RETURN(Allocator * a, cuda_allocator(device.index));
  return allocate(bytes, *a);
}

Device Buffer::device() const { return allocator_ ? allocator_->device() : Device::cpu(); }

Status Buffer::zero() { return allocator_ ? allocator_->zero(data_, size_) : ok_status(); }

Result<TensorView> Buffer::view(DType dtype, Shape shape) const {
  const size_t need = dtype_bytes(dtype, shape_numel(shape));
  if (need > size_) {
    return Status::out_of_range(
        fmt::format("view {}{} needs {} bytes; buffer holds {}", dtype_name(dtype), shape_to_string(shape), need, size_));
  }
  return TensorView(data_, dtype, std::move(shape), device());
}

}  // namespace ferry

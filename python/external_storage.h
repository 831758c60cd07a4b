// ModelStorage over tensors an engine allocated itself (its module's parameters and buffers), so
// that ferry writes straight into the memory the engine's kernels and graphs already read.
//
// reload::ModelStorage can only allocate today. This adapter allocates the storage, then swaps
// every tensor for a Buffer over the engine's memory through an allocator that hands out that
// memory and never frees it. The ferry-allocated tensors are released one by one as they are
// swapped, so the peak is the whole model twice during wrap(); a ModelStorage::wrap in reload/
// would remove that.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "reload/model_storage.h"
#include "sharding/model_spec.h"

namespace ferry::python {

// Hands out the one address it is told to; frees nothing (the engine owns the memory).
class BorrowedAllocator final : public Allocator {
 public:
  explicit BorrowedAllocator(Device device) : device_(device) {}
  void lend(void* ptr) { next_ = ptr; }
  Result<void*> allocate(size_t) override { return next_; }
  void deallocate(void*, size_t) override {}
  Device device() const override { return device_; }
  Status zero(void*, size_t) override {
    return Status::failed_precondition("borrowed storage is never zeroed by ferry");
  }

 private:
  Device device_;
  void* next_ = nullptr;
};

// One storage tensor of a rank: storage name, the parameter it belongs to, and its layout.
struct StorageEntry {
  std::string name;
  std::string param;
  std::string suffix;
  DType dtype;
  Shape shape;
  bool runtime = false;
};

Result<std::vector<StorageEntry>> storage_entries(const sharding::RankSpec& spec, DType none_dtype);

// Whether `given` can stand for storage tensor `want`: same dtype and shape, or for f8 and packed
// int4 storage a u8/i8 tensor of the same bytes (f8 of the same shape). Errors name the tensor.
Status check_external(const StorageEntry& want, const TensorView& given);

// The storage of `spec` over `tensors` (storage name -> engine memory, all on one device). Every
// storage tensor must be given; with `strict`, names outside the spec are errors, otherwise they
// are ignored. `allocator` must outlive the result.
Result<std::unique_ptr<reload::ModelStorage>> wrap_storage(const sharding::RankSpec& spec, DType none_dtype,
                                                           const std::map<std::string, TensorView>& tensors,
                                                           bool strict, std::unique_ptr<BorrowedAllocator>& allocator);

}  // namespace ferry::python

#include "transport/ucx/ucx_regions.h"

#include <string>

#include "core/buffer.h"
#include "transport/handle.h"
#include "transport/ucx/ucx_engine.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry::transport::ucx {

MappedRegion::MappedRegion(std::shared_ptr<Engine> engine, void* data, size_t size, Device device, void* mapped)
    : engine_(std::move(engine)), data_(data), size_(size), device_(device), memh_(engine_->map(mapped, size)) {}

MappedRegion::~MappedRegion() { engine_->unmap(memh_); }

Result<const uint8_t*> MappedRegion::post_bytes(size_t offset, size_t) const {
  return static_cast<const uint8_t*>(data_) + offset;
}

namespace {

// Device memory through a pinned host mirror, for UCX builds without CUDA support. The mirror is
// what UCX reads, so it is what is mapped; each post copies its range into it first.
class StagedRegion final : public MappedRegion {
 public:
  StagedRegion(std::shared_ptr<Engine> engine, void* data, size_t size, Device device, Buffer mirror)
      : MappedRegion(std::move(engine), data, size, device, mirror.data()), mirror_(std::move(mirror)) {}
  Result<const uint8_t*> post_bytes(size_t offset, size_t size) const override {
#if defined(FERRY_HAVE_CUDA)
    const cudaError_t e = cudaMemcpy(mirror_.data_as<uint8_t>() + offset, static_cast<const uint8_t*>(data()) + offset,
                                     size, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return Status::internal(std::string("ucx staging copy: ") + cudaGetErrorString(e));
    return mirror_.data_as<uint8_t>() + offset;
#else
    (void)offset, (void)size;
    return Status::internal("ucx: staging without CUDA");
#endif
  }

 private:
  Buffer mirror_;
};

}  // namespace

Result<std::unique_ptr<MemoryRegion>> register_region(const std::shared_ptr<Engine>& engine, void* data, size_t size,
                                                      Device device) {
  if (device.is_cpu()) {
    return std::unique_ptr<MemoryRegion>(std::make_unique<MappedRegion>(engine, data, size, device, data));
  }
  if (engine->cuda_capable()) return std::unique_ptr<MemoryRegion>(std::make_unique<HostRegion>(data, size));
  FERRY_ASSIGN_OR_RETURN(Allocator * pinned, pinned_allocator());
  FERRY_ASSIGN_OR_RETURN(Buffer mirror, Buffer::allocate(size, *pinned));
  return std::unique_ptr<MemoryRegion>(std::make_unique<StagedRegion>(engine, data, size, device, std::move(mirror)));
}

}  // namespace ferry::transport::ucx

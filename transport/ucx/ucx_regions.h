// ucx's memory regions (ucx_regions.cc): what a sender registers is mapped with the transport's UCP
// context once, at registration, and every post from it passes that mapping, so nothing is
// registered per bucket.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "transport/transport.h"

namespace ferry::transport::ucx {

class Engine;

// A region as registered (`data`, `size`, `device`), and `mapped`, the host bytes UCX reads: the
// region's own, or a pinned mirror of device memory.
class MappedRegion : public MemoryRegion {
 public:
  MappedRegion(std::shared_ptr<Engine> engine, void* data, size_t size, Device device, void* mapped);
  ~MappedRegion() override;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return device_; }
  // The mapping, for a post through an endpoint of the engine that made it; nullptr for any other
  // (a same-host connection's private engine has a UCP context of its own, and UCX registers what
  // it needs per operation: nothing, for shared memory and cma).
  ucp_mem_h memh_for(const Engine* e) const { return e == engine_.get() ? memh_ : nullptr; }
  // The bytes UCX reads for [offset, offset + size) of the region (a range within it).
  virtual Result<const uint8_t*> post_bytes(size_t offset, size_t size) const;

 private:
  std::shared_ptr<Engine> engine_;
  void* data_;
  size_t size_;
  Device device_;
  ucp_mem_h memh_;
};

// Host memory mapped with `engine`'s context once; device memory as it is (a CUDA-capable UCX) or
// through a pinned host mirror.
Result<std::unique_ptr<MemoryRegion>> register_region(const std::shared_ptr<Engine>& engine, void* data, size_t size,
                                                      Device device);

}  // namespace ferry::transport::ucx

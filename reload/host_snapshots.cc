#include "reload/host_snapshots.h"

#include "reload/processing.h"

namespace ferry::reload {

Status HostSnapshots::take(uint32_t layer, std::span<const TensorView> tensors) {
  if (holds(layer)) return ok_status();
  std::vector<Copy> copies;
  uint64_t bytes = 0;
  for (const TensorView& t : tensors) {
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(t.nbytes(), Device::cpu()));
    FERRY_RETURN_IF_ERROR(copy_bytes(b.data(), Device::cpu(), t.data(), t.device(), t.nbytes()));
    bytes += b.size();
    copies.push_back(Copy{t, std::move(b)});
  }
  layers_.emplace(layer, std::move(copies));
  bytes_ += bytes;
  return ok_status();
}

Status HostSnapshots::restore() const {
  for (const auto& [layer, copies] : layers_) {
    for (const Copy& c : copies) {
      FERRY_RETURN_IF_ERROR(
          copy_bytes(c.target.data(), c.target.device(), c.bytes.data(), Device::cpu(), c.target.nbytes()));
    }
  }
  return ok_status();
}

void HostSnapshots::drop() {
  layers_.clear();
  bytes_ = 0;
}

}  // namespace ferry::reload

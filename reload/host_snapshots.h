// Host-side snapshots of registered storage, for rollback (FERRY_ROLLBACK=host): before an update
// first writes a layer's storage, every registered tensor of that layer (parameters and runtime
// tensors alike) is copied to host memory; restore() copies the bytes back into the same storage,
// so identities never change and captured graphs keep reading live memory.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"

namespace ferry::reload {

class HostSnapshots {
 public:
  // Copies `tensors` (the registered views of layer `layer`) to host memory, unless the layer is
  // already held: the first snapshot of a layer is the one to go back to.
  Status take(uint32_t layer, std::span<const TensorView> tensors);
  bool holds(uint32_t layer) const { return layers_.count(layer) != 0; }
  // Copies every snapshot back into the tensor it was taken from.
  Status restore() const;
  void drop();
  size_t layers() const { return layers_.size(); }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Copy {
    TensorView target;
    Buffer bytes;
  };
  std::map<uint32_t, std::vector<Copy>> layers_;
  uint64_t bytes_ = 0;
};

}  // namespace ferry::reload

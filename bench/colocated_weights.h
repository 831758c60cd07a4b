// The trainer side of ferry-bench-colocated on the GPU (CUDA builds): the weights a trainer process
// holds, one allocation per tensor as PyTorch's allocator gives large tensors, the new values of
// each update, and the device copy bandwidth the memory floor is measured with.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/status.h"
#include "core/tensor.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {
struct SenderInfo;
}  // namespace ferry::sharding

namespace ferry::bench {

// Device-to-device copy bandwidth (bytes read plus bytes written per second), median of 9.
Result<double> copy_bandwidth(int device);

struct Weights {
  std::vector<Buffer> buffers;
  std::map<std::string, TensorView> views;
  Buffer pool;  // random bf16 values the weights are cut from
  uint64_t params = 0;
};

// Every tensor of the manifest on `device`, each its own allocation; with `held`, only the box of
// each tensor it declares (a sharded trainer rank's rows).
Result<Weights> allocate_weights(const sharding::Manifest& manifest, Device device,
                                 const sharding::SenderInfo* held = nullptr);

// New values for every weight: a slice of the pool that shifts with `step`.
Status change_weights(Weights& w, uint64_t step);

}  // namespace ferry::bench

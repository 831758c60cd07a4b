// Adam steps on a trainer's bf16 weights in device memory, as a mixed-precision trainer takes them:
// fp32 master weights (the bf16 values at the start), bf16 first and second moments, beta 0.9 and
// 0.999, lr 1e-6, and the bf16 weights recast from the master after each step. The gradients are
// seeded noise around a fixed direction per element (what a loss landscape gives a few steps
// apart). What changes between two versions is then what an RL step at a small learning rate
// changes: the bf16 elements whose master weight crossed a rounding boundary.
#pragma once

#include <memory>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry::bench {

class DeviceAdam {
 public:
  // `weights`: bf16 tensors on one CUDA device, updated in place by step().
  static Result<std::unique_ptr<DeviceAdam>> create(std::vector<TensorView> weights);
  virtual ~DeviceAdam() = default;
  // One step over every weight; returns once the weights hold it.
  virtual Status step() = 0;
};

}  // namespace ferry::bench

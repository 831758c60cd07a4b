// The storage a rank's kernels read: every tensor of every parameter's scheme layout, allocated
// once at startup. Names follow the engine: "<param>" for the weight itself, "<param>_scale" style
// suffixes for the rest (see storage_name()).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "kernels/quantize.h"
#include "sharding/model_spec.h"

namespace ferry::reload {

// "x.weight" with suffix "weight" -> "x.weight"; with "weight_scale" -> "x.weight_scale"; fused experts
// "x.w13_weight" -> "x.w13_weight_scale".
std::string storage_name(const std::string& param, const std::string& suffix);

// The storage tensors of one parameter, in kernels::storage_layout order.
// `layout`: the rank's engine layout (RankSpec::layout).
// What an engine layout needs of a whole spec beyond each parameter's own layout: under vllm, no
// bias beside an int4_group or gptq_int4 (Marlin) weight.
Status check_engine_layout(const sharding::RankSpec& spec);

Result<std::vector<kernels::StorageTensor>> param_layout(const sharding::ParamSpec& p, DType none_dtype,
                                                         EngineLayout layout = EngineLayout::kFerry);

class ModelStorage {
 public:
  // Allocates (zeroed) every tensor the parameters of `spec` need on `device`.
  static Result<ModelStorage> allocate(const sharding::RankSpec& spec, Device device, DType none_dtype = DType::kBF16);

  // The live table: what kernels and captured programs read.
  const std::map<std::string, TensorView>& tensors() const { return views_; }
  Result<TensorView> get(const std::string& name) const;
  // Swaps a tensor's storage for a new buffer. Only a broken processing step would do this; tests
  // use it to prove the census and the audit catch it.
  Status replace(const std::string& name, Buffer buffer);
  Device device() const { return device_; }
  // The dtype its `none` parameters are stored in (the engine writes them so).
  DType none_dtype() const { return none_dtype_; }
  uint64_t bytes() const;

 private:
  Device device_;
  DType none_dtype_ = DType::kBF16;
  std::map<std::string, Buffer> buffers_;
  std::map<std::string, TensorView> views_;
};

}  // namespace ferry::reload

// The layer registry: every tensor a kernel reads when it runs, registered explicitly with its layer
// (parameters: live storage written from checkpoint data; runtime tensors: workspaces, permutations,
// lookup tables, derived scales). Identity (data pointer and byte size) is recorded once, at
// registration, and never changes; the census compares it with the live table after every update.
//
// Kernels and captured programs take their tensors from here, never from a pointer of their own.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ferry::reload {

struct Identity {
  const void* data = nullptr;
  size_t bytes = 0;
  bool operator==(const Identity&) const = default;
  bool contains(const void* p, size_t n) const;
};

enum class TensorRole : uint8_t { kParameter, kRuntime };

struct RegisteredTensor {
  std::string name;
  std::string layer;
  TensorRole role = TensorRole::kParameter;
  TensorView view;    // the registered storage, as kernels see it
  Identity identity;  // recorded at registration
};

struct Census {
  uint64_t moved = 0;
  uint64_t registered = 0;
  std::vector<std::string> moved_names;
  std::string to_string() const;  // "moved=0/42"
};

// Where a tensor lives now: the engine's live table (ModelStorage::tensors()).
using LiveTable = std::map<std::string, TensorView>;

class LayerRegistry {
 public:
  // Registers `view` under `name` in `layer`; a second registration of one name is an error.
  Status add(const std::string& layer, const std::string& name, TensorRole role, const TensorView& view);

  Result<const RegisteredTensor*> find(const std::string& name) const;
  const std::vector<RegisteredTensor>& tensors() const { return tensors_; }
  // Indices into tensors() of one layer, in registration order.
  std::vector<size_t> layer_tensors(const std::string& layer) const;
  std::vector<std::string> layers() const;
  size_t size() const { return tensors_.size(); }

  // moved m/N: a registered tensor moved when the live table lacks it or shows another identity.
  Census census(const LiveTable& live) const;
  // The registered tensor whose live storage holds [p, p + n), or null. Only tensors whose live
  // identity still equals their registration count: memory a broken step swapped out is not live.
  const RegisteredTensor* owner_of(const LiveTable& live, const void* p, size_t n) const;

 private:
  std::vector<RegisteredTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

}  // namespace ferry::reload

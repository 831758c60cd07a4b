// What a trainer rank holds of the manifest and where it lies in its memory: turns each
// send(name, tensor) into the parts to send (a manifest tensor, the box of it, and the view of the
// box's elements). A name is a checkpoint tensor whose held box is a local tensor of its own, or a
// local tensor of a source layout (sharding/source_layout.h) holding several boxes at their rows
// (Megatron's fused linear_qkv holds boxes of q_proj, k_proj and v_proj).
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "sharding/planner.h"
#include "sharding/source_layout.h"

namespace ferry::coordinator {

class LocalHoldings {
 public:
  struct Part {
    size_t source;  // manifest index
    Region box;     // of the global tensor
    TensorView view;  // its elements, shaped as the box
  };

  // For an update of `manifest`: `holdings` (owns / holds; both empty: every tensor whole) or,
  // when not empty, `layout` (then `holdings` must be empty). `who` names this trainer rank in errors.
  Status reset(const sharding::Manifest& manifest, const sharding::SenderInfo& holdings,
               const sharding::SourceLayout& layout, std::string who);
  // The parts `tensor`, sent under `name`, backs; each name once per update.
  Result<std::vector<Part>> take(const std::string& name, const TensorView& tensor);
  // The names not sent yet, in the order their first tensor comes in `source_order`.
  std::vector<std::string> wanted(const std::vector<int>& source_order) const;

 private:
  struct Entry {
    size_t source;
    Region box;
    int64_t row;  // first row in the local tensor
    bool alone;   // the local tensor is the box itself (sent under the checkpoint name)
  };
  Status add(const std::string& local, const std::string& name, const Region* box, int64_t row, bool alone);

  const sharding::Manifest* manifest_ = nullptr;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::vector<Entry>> by_local_;
  std::map<std::string, bool> sent_;
  std::vector<std::vector<std::string>> locals_of_;  // per manifest tensor, the local names holding it
  std::string who_;
};

}  // namespace ferry::coordinator

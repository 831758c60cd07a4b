// What a trainer rank holds of the manifest and where it lies in its memory: turns each
// send(name, tensor) into the parts to send (a manifest tensor, the box of it, and the view of the
// box's elements). A name is a checkpoint tensor whose held box is a local tensor of its own, or a
// local tensor of a source layout (sharding/source_layout.h) holding several boxes at their rows
// (Megatron's fused linear_qkv holds boxes of q_proj, k_proj and v_proj).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <unordered_map>
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
  // The same manifest, holdings and layout as the last reset keep what was worked out from them
  // (updates after the first only clear what was sent).
  Status reset(const sharding::Manifest& manifest, const sharding::SenderInfo& holdings,
               const sharding::SourceLayout& layout, std::string who);
  // The parts `tensor`, sent under `name`, backs; each name once per update.
  Result<std::vector<Part>> take(const std::string& name, const TensorView& tensor);
  // The names not sent yet, in the order their first tensor comes in `source_order`: references
  // into this object, valid until the next reset().
  std::vector<std::reference_wrapper<const std::string>> wanted(const std::vector<int>& source_order) const;

 private:
  struct Entry {
    size_t source;
    Region box;
    int64_t row;  // first row in the local tensor
    bool alone;   // the local tensor is the box itself (sent under the checkpoint name)
  };
  struct Local {
    std::string name;
    std::vector<Entry> entries;
  };
  Status build(const sharding::Manifest& manifest, const sharding::SenderInfo& holdings,
               const sharding::SourceLayout& layout);
  Status add(const std::string& local, const std::string& name, const Region* box, int64_t row, bool alone);

  // What the last reset was given (`built_`: and worked out without error).
  sharding::Manifest manifest_;
  sharding::SenderInfo holdings_;
  sharding::SourceLayout layout_;
  bool built_ = false;
  std::unordered_map<std::string, size_t> index_;     // manifest name -> index
  std::unordered_map<std::string, size_t> by_local_;  // local name -> locals_
  std::vector<Local> locals_;
  std::vector<char> sent_;                      // per local: sent in this update
  std::vector<std::vector<size_t>> locals_of_;  // per manifest tensor, the locals holding it
  std::string who_;
};

}  // namespace ferry::coordinator

// The checks of rank specs against a manifest, in time linear in their slices: the planner runs them
// over every slice of every rank (8.96 million for Kimi-K2 on 16 replicas of TP 8), and
// check_manifest() and validate_rank_spec() are these same checks.
#pragma once

#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

// Manifest names to indices. find() with a hint (the index the name had in a rank alike: the same
// TP rank of the previous replica) compares one name instead of hashing it.
class NameIndex {
 public:
  explicit NameIndex(const Manifest& manifest);
  // The first name the manifest holds twice, or nullptr.
  const std::string* duplicate() const { return duplicate_; }
  int find(std::string_view name) const {
    auto it = map_.find(name);
    return it == map_.end() ? -1 : it->second;
  }
  int find(std::string_view name, int hint) const {
    if (hint >= 0 && static_cast<size_t>(hint) < manifest_.size() && manifest_[static_cast<size_t>(hint)].name == name) {
      return hint;
    }
    return find(name);
  }

 private:
  const Manifest& manifest_;
  std::unordered_map<std::string_view, int> map_;
  const std::string* duplicate_ = nullptr;
};

// One parameter's slices, each against its source's shape (`source_shapes[i]` for slice i;
// nullptr: the source is not in the manifest): inside its source, of a rank its destination can
// take, landing inside the parameter, disjoint from the others, not covering more than it. Linear
// in slices (plus a sort where their destinations are not in order); the error, if any, is
// first_slice_error()'s.
Status check_param_slices(const ParamSpec& p, std::span<const Shape* const> source_shapes);
// The same checks one slice after another, each slice against every slice before it (quadratic):
// the first error in slice order.
Status first_slice_error(const ParamSpec& p, std::span<const Shape* const> source_shapes);

// check_manifest(): every tensor a rank expects is sent with its dtype and shape, every sent tensor
// is expected by some rank, and every rank's parameters pass the checks above against the tensors
// that rank expects. `slice_sources`, when given, receives the manifest index of every slice's
// source, rank after rank, parameter after parameter, slice after slice.
Status check_and_resolve(const Manifest& manifest, const std::vector<RankSpec>& ranks, const NameIndex& index,
                         std::vector<int>* slice_sources);

}  // namespace ferry::sharding

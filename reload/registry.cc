#include "reload/registry.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::reload {

bool Identity::contains(const void* p, size_t n) const {
  const auto* b = static_cast<const char*>(data);
  const auto* q = static_cast<const char*>(p);
  return data != nullptr && q >= b && n <= bytes && q - b <= static_cast<std::ptrdiff_t>(bytes - n);
}

std::string Census::to_string() const { return fmt::format("moved={}/{}", moved, registered); }

Status LayerRegistry::add(const std::string& layer, const std::string& name, TensorRole role, const TensorView& view) {
  if (by_name_.count(name)) return Status::invalid_argument(fmt::format("{}: registered twice", name));
  if (view.numel() > 0 && view.empty()) return Status::invalid_argument(fmt::format("{}: null storage", name));
  by_name_.emplace(name, tensors_.size());
  tensors_.push_back({name, layer, role, view, Identity{view.data(), view.nbytes()}});
  return ok_status();
}

Result<const RegisteredTensor*> LayerRegistry::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Status::not_found(fmt::format("no registered tensor {}", name));
  return &tensors_[it->second];
}

std::vector<size_t> LayerRegistry::layer_tensors(const std::string& layer) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].layer == layer) out.push_back(i);
  }
  return out;
}

std::vector<std::string> LayerRegistry::layers() const {
  std::vector<std::string> out;
  for (const auto& t : tensors_) {
    if (out.empty() || out.back() != t.layer) {
      bool seen = false;
      for (const auto& l : out) seen = seen || l == t.layer;
      if (!seen) out.push_back(t.layer);
    }
  }
  return out;
}

Census LayerRegistry::census(const LiveTable& live) const {
  Census c;
  c.registered = tensors_.size();
  // The census runs after every update: one walk over both tables, which are ordered by name, instead
  // of a look-up in the live table per registered tensor.
  std::vector<size_t> moved;
  auto it = live.begin();
  for (const auto& [name, i] : by_name_) {
    int order = 1;
    while (it != live.end() && (order = it->first.compare(name)) < 0) ++it;
    const TensorView* v = it != live.end() && order == 0 ? &it->second : nullptr;
    if (v == nullptr || Identity{v->data(), v->nbytes()} != tensors_[i].identity) moved.push_back(i);
  }
  // Named in registration order.
  std::sort(moved.begin(), moved.end());
  c.moved = moved.size();
  for (size_t i : moved) c.moved_names.push_back(tensors_[i].name);
  return c;
}

const RegisteredTensor* LayerRegistry::owner_of(const LiveTable& live, const void* p, size_t n) const {
  for (const auto& t : tensors_) {
    if (!t.identity.contains(p, n)) continue;
    auto it = live.find(t.name);
    if (it != live.end() && Identity{it->second.data(), it->second.nbytes()} == t.identity) return &t;
  }
  return nullptr;
}

}  // namespace ferry::reload

#include "reload/registry.h"

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
  for (const auto& t : tensors_) {
    auto it = live.find(t.name);
    if (it == live.end() || Identity{it->second.data(), it->second.nbytes()} != t.identity) {
      ++c.moved;
      c.moved_names.push_back(t.name);
    }
  }
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

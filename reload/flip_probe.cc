#include "reload/flip_probe.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "reload/processing.h"

namespace ferry::reload {
namespace {

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Flips one tensor in place; applying it twice restores the values.
Status flip(const RegisteredTensor& t) {
  const TensorView& v = t.view;
  std::vector<uint8_t> host(v.nbytes());
  FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), v.data(), v.device(), host.size()));
  if (v.dtype() == DType::kI32) {
    auto* p = reinterpret_cast<int32_t*>(host.data());
    std::reverse(p, p + v.numel());
  } else if (v.dtype() == DType::kF32) {
    for (int64_t i = 0; i < v.numel(); ++i) host[static_cast<size_t>(i) * 4 + 3] ^= 0x80;
  } else if (v.dtype() == DType::kF16 || v.dtype() == DType::kBF16) {
    for (int64_t i = 0; i < v.numel(); ++i) host[static_cast<size_t>(i) * 2 + 1] ^= 0x80;
  } else {
    return Status::invalid_argument(fmt::format("flip probe: no legal wrong value for {} ({})", t.name, v.describe()));
  }
  return copy_bytes(v.data(), v.device(), host.data(), Device::cpu(), host.size());
}

}  // namespace

std::string FlipReport::to_string() const {
  return fmt::format("flip: {} tensors flipped, outputs {}", flipped.size(), changed ? "changed" : "UNCHANGED");
}

std::vector<std::string> permutation_tensors(const LayerRegistry& registry) {
  std::vector<std::string> out;
  for (const auto& t : registry.tensors()) {
    if (t.role == TensorRole::kRuntime && t.view.dtype() == DType::kI32 && t.view.rank() == 1 &&
        ends_with(t.name, ".perm")) {
      out.push_back(t.name);
    }
  }
  return out;
}

std::vector<std::string> scale_tensors(const LayerRegistry& registry) {
  std::vector<std::string> out;
  for (const auto& t : registry.tensors()) {
    const DType d = t.view.dtype();
    if ((d == DType::kF32 || d == DType::kF16) && (ends_with(t.name, "scale") || ends_with(t.name, "scales"))) {
      out.push_back(t.name);
    }
  }
  return out;
}

Result<FlipReport> flip_probe(const LayerRegistry& registry, const std::vector<std::string>& targets,
                              const std::function<Result<std::vector<uint8_t>>()>& run) {
  if (targets.empty()) return Status::invalid_argument("flip probe: no tensors to flip");
  std::vector<const RegisteredTensor*> ts;
  for (const std::string& name : targets) {
    FERRY_ASSIGN_OR_RETURN(const RegisteredTensor* t, registry.find(name));
    ts.push_back(t);
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<uint8_t> before, run());
  FlipReport r;
  Status st = ok_status();
  size_t done = 0;
  for (; done < ts.size() && st.ok(); ++done) {
    st = flip(*ts[done]);
    if (st.ok()) r.flipped.push_back(ts[done]->name);
  }
  Result<std::vector<uint8_t>> after = st.ok() ? run() : Result<std::vector<uint8_t>>(st);
  // Restore whatever was flipped, even when the replay failed.
  for (size_t i = 0; i < r.flipped.size(); ++i) {
    Status undo = flip(*ts[i]);
    if (!undo.ok()) return undo.with_context("flip probe: restoring " + ts[i]->name);
  }
  if (!after.ok()) return after.status().with_context("flip probe");
  r.changed = *after != before;
  return r;
}

}  // namespace ferry::reload

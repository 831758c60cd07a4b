#include "coordinator/local_holdings.h"

#include <algorithm>

#include <fmt/format.h>

namespace ferry::coordinator {
namespace {

// expect_tensor() for send(name), its words built only for an error (every update takes every
// tensor through here).
Status expect_sent(const TensorView& tensor, const std::string& name, DType dtype, const Shape& shape) {
  if (expect_tensor(tensor, {}, dtype, shape).ok()) return ok_status();
  return expect_tensor(tensor, "send(" + name + ")", dtype, shape);
}

}  // namespace

Status LocalHoldings::add(const std::string& local, const std::string& name, const Region* box, int64_t row, bool alone) {
  auto it = index_.find(name);
  if (it == index_.end()) return Status::invalid_argument(fmt::format("{}: holdings name {}, which is not in the manifest", who_, name));
  const Region r = box ? *box : Region::whole(manifest_[it->second].shape);
  auto [at, fresh] = by_local_.try_emplace(local, locals_.size());
  if (fresh) locals_.push_back(Local{local, {}});
  auto& entries = locals_[at->second].entries;
  if (alone && !entries.empty()) {
    return Status::invalid_argument(fmt::format(
        "{}: holdings name {} twice; without a source layout each held box is a local tensor sent under its name", who_,
        name));
  }
  entries.push_back({it->second, r, row, alone});
  auto& locals = locals_of_[it->second];
  if (std::find(locals.begin(), locals.end(), at->second) == locals.end()) locals.push_back(at->second);
  return ok_status();
}

Status LocalHoldings::reset(const sharding::Manifest& manifest, const sharding::SenderInfo& holdings,
                            const sharding::SourceLayout& layout, std::string who) {
  who_ = std::move(who);
  // Every update of a training run sends the same manifest from the same holdings: only the sent
  // flags start afresh (this runs between the pause and the first byte).
  if (!built_ || manifest != manifest_ || holdings != holdings_ || layout != layout_) {
    built_ = false;
    manifest_ = manifest;
    holdings_ = holdings;
    layout_ = layout;
    FERRY_RETURN_IF_ERROR(build(manifest_, holdings_, layout_));
    built_ = true;
  }
  sent_.assign(locals_.size(), 0);
  return ok_status();
}

Status LocalHoldings::build(const sharding::Manifest& manifest, const sharding::SenderInfo& holdings,
                            const sharding::SourceLayout& layout) {
  index_.clear();
  by_local_.clear();
  locals_.clear();
  locals_of_.assign(manifest.size(), {});
  for (size_t i = 0; i < manifest.size(); ++i) index_[manifest[i].name] = i;
  if (!layout.empty()) {
    if (!holdings.owns.empty() || !holdings.holds.empty()) {
      return Status::invalid_argument(fmt::format("{}: both holdings and a source layout; the layout declares the holdings", who_));
    }
    for (const auto& b : layout.boxes) FERRY_RETURN_IF_ERROR(add(b.local, b.box.name, &b.box.region, b.row, false));
    return ok_status();
  }
  if (holdings.owns.empty() && holdings.holds.empty()) {
    for (const auto& t : manifest) FERRY_RETURN_IF_ERROR(add(t.name, t.name, nullptr, 0, true));
    return ok_status();
  }
  for (const auto& name : holdings.owns) FERRY_RETURN_IF_ERROR(add(name, name, nullptr, 0, true));
  for (const auto& h : holdings.holds) FERRY_RETURN_IF_ERROR(add(h.name, h.name, &h.region, 0, true));
  return ok_status();
}

Result<std::vector<LocalHoldings::Part>> LocalHoldings::take(const std::string& name, const TensorView& tensor) {
  const auto what = [&] { return "send(" + name + ")"; };
  auto it = by_local_.find(name);
  if (!built_ || it == by_local_.end()) {
    if (index_.count(name)) {
      return Status::invalid_argument(
          fmt::format("{}: {} declared no part of it in its UpdateOptions holdings", what(), who_));
    }
    return Status::invalid_argument(what() + ": not in this update's manifest nor a local tensor of its source layout");
  }
  if (sent_[it->second]) return Status::invalid_argument(what() + ": already sent in this update");
  std::vector<Part> parts;
  for (const Entry& e : locals_[it->second].entries) {
    const sharding::SourceTensor& meta = manifest_[e.source];
    if (e.alone) {
      FERRY_RETURN_IF_ERROR(expect_sent(tensor, name, meta.dtype, e.box.size));
      parts.push_back({e.source, e.box, tensor});
      continue;
    }
    // A box at rows [row, row + its rows) of the local tensor, spanning its other dimensions.
    const Shape& want = tensor.shape();
    const bool fits = want.size() == e.box.size.size() && !want.empty() && e.row + e.box.size[0] <= want[0] &&
                      std::equal(want.begin() + 1, want.end(), e.box.size.begin() + 1);
    if (!fits) {
      return Status::invalid_argument(
          fmt::format("{}: a local tensor of shape {} cannot hold {} {} at row {} (its source layout)", what(),
                      shape_to_string(tensor.shape()), meta.name, e.box.to_string(), e.row));
    }
    FERRY_RETURN_IF_ERROR(expect_sent(tensor, name, meta.dtype, tensor.shape()));
    const size_t row_bytes = tensor.nbytes() / static_cast<size_t>(std::max<int64_t>(want[0], 1));
    const auto* base = static_cast<const uint8_t*>(tensor.data()) + static_cast<size_t>(e.row) * row_bytes;
    parts.push_back({e.source, e.box, TensorView(const_cast<uint8_t*>(base), meta.dtype, e.box.size, tensor.device())});
  }
  sent_[it->second] = 1;
  return parts;
}

std::vector<std::reference_wrapper<const std::string>> LocalHoldings::wanted(
    const std::vector<int>& source_order) const {
  std::vector<std::reference_wrapper<const std::string>> out;
  if (!built_) return out;
  std::vector<char> seen(locals_.size(), 0);
  for (int i : source_order) {
    for (const size_t local : locals_of_[static_cast<size_t>(i)]) {
      if (sent_[local] || seen[local]) continue;
      seen[local] = 1;
      out.emplace_back(locals_[local].name);
    }
  }
  return out;
}

}  // namespace ferry::coordinator

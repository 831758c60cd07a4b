#include "reload/coverage.h"

#include <fmt/format.h>

namespace ferry::reload {
namespace {

bool contains(const Region& outer, const Region& inner) {
  if (outer.rank() != inner.rank()) return false;
  for (size_t i = 0; i < outer.size.size(); ++i) {
    if (inner.offset[i] < outer.offset[i] || inner.offset[i] + inner.size[i] > outer.offset[i] + outer.size[i]) {
      return false;
    }
  }
  return true;
}

}  // namespace

Coverage::Coverage(std::string name, Shape shape, std::vector<Region> expected)
    : name_(std::move(name)), shape_(std::move(shape)), expected_(std::move(expected)) {
  for (const Region& r : expected_) expected_numel_ += r.numel();
  reset();
}

void Coverage::reset() {
  covered_ = 0;
  covered_per_slice_.assign(expected_.size(), 0);
  // The regions stay allocated for the next update (a plan's pieces are the same every update):
  // only their counts go back to zero.
  received_.resize(expected_.size());
  received_count_.assign(expected_.size(), 0);
}

Status Coverage::add(const Region& region) {
  if (!region.inside(shape_)) {
    return Status::out_of_range(
        fmt::format("{}: piece {} lies outside the parameter's shape {}", name_, region.to_string(), shape_to_string(shape_)));
  }
  if (region.numel() == 0) return Status::invalid_argument(fmt::format("{}: empty piece {}", name_, region.to_string()));
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (!contains(expected_[i], region)) continue;
    std::vector<Region>& received = received_[i];
    size_t& count = received_count_[i];
    for (size_t k = 0; k < count; ++k) {
      const Region& r = received[k];
      if (r.overlaps(region)) {
        return Status::invalid_argument(fmt::format("{}: piece {} {} piece {} already written", name_, region.to_string(),
                                                    r == region ? "duplicates" : "overlaps", r.to_string()));
      }
    }
    if (count < received.size()) {
      received[count] = region;  // into the vectors of an earlier update's region: no allocation
    } else {
      received.push_back(region);
    }
    ++count;
    covered_per_slice_[i] += region.numel();
    covered_ += region.numel();
    return ok_status();
  }
  return Status::out_of_range(
      fmt::format("{}: piece {} does not lie inside one expected slice of the parameter", name_, region.to_string()));
}

std::vector<size_t> Coverage::incomplete_slices() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (covered_per_slice_[i] != expected_[i].numel()) out.push_back(i);
  }
  return out;
}

std::string Coverage::describe_gaps() const {
  std::string out;
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (covered_per_slice_[i] == expected_[i].numel()) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} ({} of {} elements)", expected_[i].to_string(), covered_per_slice_[i], expected_[i].numel());
  }
  return out;
}

}  // namespace ferry::reload

// Exact coverage of one parameter by regions: every element of every expected slice is written
// exactly once. Duplicates, overlaps, pieces outside every slice and gaps are errors found by
// regions, never by counting elements alone.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace ferry::reload {

class Coverage {
 public:
  Coverage() = default;
  Coverage(std::string name, Shape shape, std::vector<Region> expected);

  // Records `region`; fails (InvalidArgument / OutOfRange, naming the parameter and region) when it
  // overlaps a recorded one or does not lie inside a single expected slice.
  Status add(const Region& region);
  bool complete() const { return covered_ == expected_numel_; }
  void reset();
  // Regions of the expected slices not yet fully covered, for error messages.
  std::string describe_gaps() const;
  // Indices of the expected slices (in the order given) not yet fully covered.
  std::vector<size_t> incomplete_slices() const;
  int64_t covered() const { return covered_; }
  int64_t expected() const { return expected_numel_; }

 private:
  std::string name_;
  Shape shape_;
  std::vector<Region> expected_;
  std::vector<int64_t> covered_per_slice_;
  std::vector<std::vector<Region>> received_;  // per expected slice; the first received_count_ hold
  std::vector<size_t> received_count_;         // this update's regions
  int64_t expected_numel_ = 0;
  int64_t covered_ = 0;
};

}  // namespace ferry::reload

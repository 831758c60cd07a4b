// A tensor's boxes compared once per update against the copy a sender kept of it (delta_base.h):
// every box of the tensor that goes to some rank as a delta, all in one job on the work pool (slices
// of every box side by side, rather than one part's compare after another), each read where it
// lies: the rows of a column box are compared in place, neither side packed first. A part of a box
// (the rows one bucket took) is then encoded from the box's scan exactly as encode_delta() would
// encode that part compared alone.
//
// With `keep`, the same pass brings the kept copy up to the new version: each run of 4 Ki elements
// (or a row) in which the compare found a change is copied over the old one right after the compare
// read both (still in the core's cache), so the copy needs no second pass over the tensor. Only where the boxes tile
// the tensor exactly (pairwise disjoint, every element in one): the copy is then the new version
// whole, and no box is compared against elements another box already wrote.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "dataplane/delta.h"
#include "dataplane/delta_scan.h"

namespace ferry::dataplane {

class TensorScan {
 public:
  // Compares `boxes` of `now` (the local tensor: contiguous, on the host, whole-byte elements) with
  // the same boxes of `old` (the kept copy of it, the same dtype and shape), each distinct box once.
  // A box whose rows are not whole groups of 8 elements (and not one run) is left out: the caller
  // compares its parts alone. `keep`: write the changes into `old` as well, when every box is in and
  // they tile the tensor; returns whether it did (else `old` is left as it was). `version`: the
  // version `old` held, which the parts encoded from this scan are deltas against.
  bool compare(const TensorView& now, uint8_t* old, const std::vector<Region>& boxes, bool xor_values, bool keep,
               uint64_t version);
  // Whether `part` (whole rows, along the first dimension, of a box compared) can be encoded.
  bool covers(const Region& part) const;
  // `part`'s changed elements encoded as encode_delta() encodes them compared alone (covers() first).
  DeltaChoice encode(const Region& part, bool prefer_delta, std::vector<uint8_t>& out) const;
  uint64_t version() const { return version_; }
  uint64_t compared_bytes() const { return compared_bytes_; }
  // Nothing covered.
  void clear();
  // Nothing covered, and the memory of boxes past 64 MiB given back (a sender's, once an update).
  void trim();

 private:
  struct Segment {
    uint64_t first = 0;  // the slice's first element; its values begin at values + first * elem
    uint64_t end = 0;
    uint64_t count = 0;
    detail::RunsSlice runs;  // its runs, found right after its compare
  };
  struct Box {
    Region region;
    uint64_t first = 0, rows = 0, row_elems = 0, stride = 0;  // where it lies in the tensor, in elements
    uint64_t n = 0, changed = 0;
    detail::Scratch bitmap, values;
    std::vector<Segment> segments;
    std::vector<detail::Scratch> pairs;  // each segment's runs' pairs
  };
  const Box* box_of(const Region& part) const;

  std::vector<Box> boxes_;
  size_t used_ = 0;
  size_t elem_ = 1;
  uint64_t version_ = 0;
  uint64_t compared_bytes_ = 0;
};

}  // namespace ferry::dataplane

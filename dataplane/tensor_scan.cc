// A tensor's boxes compared together (tensor_scan.h).
#include "dataplane/tensor_scan.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/dtype.h"
#include "core/parallel.h"
#include "core/work_pool.h"

namespace ferry::dataplane {
namespace {

// A slice of a box is at least this many elements (tens of microseconds of one core's compare,
// several times what the work pool takes to hand it out), and a box takes at most
// kSlicesPerThread slices per thread, so that slices of unequal boxes even out.
constexpr uint64_t kSliceElements = uint64_t{1} << 16;
constexpr size_t kSlicesPerThread = 2;
// A compare call covers at most this many elements of a row: when it found changes, the new
// elements are copied over the kept ones while both sides are still in the core's cache (copying
// only the changed groups of 8 costs more in branches than it saves in bytes: at 3% of bf16
// elements changed, most 64-byte lines hold one).
constexpr uint64_t kChunkElements = 4096;

struct Layout {
  uint64_t first = 0, rows = 1, row_elems = 0, stride = 0;
};

// Where `box` lies in a contiguous tensor of `shape`: rows along the first two dimensions, each
// one run (the dimensions past the second whole); one run when its rows are the tensor's. nullopt
// when it is not rows, or when rows that are not one run are not whole groups of 8 elements (each
// row's bitmap must begin at a byte of its own).
std::optional<Layout> layout_of(const Shape& shape, const Region& box) {
  Layout l;
  if (shape.empty()) {
    l.row_elems = l.stride = 1;
    return l;
  }
  if (shape.size() == 1) {
    l.first = static_cast<uint64_t>(box.offset[0]);
    l.row_elems = l.stride = static_cast<uint64_t>(box.size[0]);
    return l;
  }
  uint64_t inner = 1;
  for (size_t d = 2; d < shape.size(); ++d) {
    if (box.offset[d] != 0 || box.size[d] != shape[d]) return std::nullopt;
    inner *= static_cast<uint64_t>(shape[d]);
  }
  const uint64_t row = static_cast<uint64_t>(shape[1]) * inner;
  l.first = static_cast<uint64_t>(box.offset[0]) * row + static_cast<uint64_t>(box.offset[1]) * inner;
  l.row_elems = static_cast<uint64_t>(box.size[1]) * inner;
  l.stride = row;
  l.rows = static_cast<uint64_t>(box.size[0]);
  if (l.row_elems == row || l.rows <= 1) {
    l.row_elems *= l.rows;
    l.stride = l.row_elems;
    l.rows = 1;
  } else if (l.row_elems % 8 != 0) {
    return std::nullopt;
  }
  return l;
}

// The 64 bits of `bitmap` from bit `at` (the bitmap padded past its last word, as scan_bitmap()
// leaves it).
uint64_t bits_at(const uint8_t* bitmap, uint64_t at) {
  const uint64_t byte = at / 8, shift = at % 8;
  uint64_t x;
  std::memcpy(&x, bitmap + byte, 8);
  if (shift != 0) x = (x >> shift) | (static_cast<uint64_t>(bitmap[byte + 8]) << (64 - shift));
  return x;
}

uint64_t popcount(uint64_t x) { return static_cast<uint64_t>(__builtin_popcountll(x)); }

// The set bits of [from, to).
uint64_t count_bits(const uint8_t* bitmap, uint64_t from, uint64_t to) {
  uint64_t k = 0;
  for (uint64_t at = from; at < to; at += 64) {
    const uint64_t x = bits_at(bitmap, at);
    k += popcount(to - at >= 64 ? x : x & ((uint64_t{1} << (to - at)) - 1));
  }
  return k;
}

}  // namespace

void TensorScan::clear() {
  used_ = 0;
  compared_bytes_ = 0;
}

void TensorScan::trim() {
  clear();
  for (Box& b : boxes_) {
    b.bitmap.trim();
    b.values.trim();
    for (detail::Scratch& s : b.pairs) s.trim();
  }
}

bool TensorScan::compare(const TensorView& now, uint8_t* old, const std::vector<Region>& boxes, bool xor_values,
                         bool keep, uint64_t version) {
  clear();
  version_ = version;
  elem_ = static_cast<size_t>(dtype_bits(now.dtype()) / 8);
  if (elem_ == 0 || dtype_bits(now.dtype()) % 8 != 0) return false;
  std::vector<const Region*> distinct;
  for (const Region& b : boxes) {
    if (std::none_of(distinct.begin(), distinct.end(), [&](const Region* d) { return *d == b; }))
      distinct.push_back(&b);
  }
  // The boxes tile the tensor: pairwise disjoint, and as many elements as it has.
  uint64_t covered = 0;
  for (size_t i = 0; i < distinct.size(); ++i) {
    covered += static_cast<uint64_t>(distinct[i]->numel());
    for (size_t j = 0; j < i; ++j) keep = keep && !distinct[i]->overlaps(*distinct[j]);
  }
  keep = keep && covered == static_cast<uint64_t>(now.numel());
  if (boxes_.size() < distinct.size()) boxes_.resize(distinct.size());
  struct Job {
    Box* box;
    size_t segment;
  };
  std::vector<Job> jobs;
  const size_t most = std::max<size_t>(host_threads() * kSlicesPerThread, 1);
  for (const Region* r : distinct) {
    const auto layout = layout_of(now.shape(), *r);
    if (!layout) {
      keep = false;
      continue;
    }
    Box& b = boxes_[used_++];
    b.region = *r;
    b.first = layout->first;
    b.rows = layout->rows;
    b.row_elems = layout->row_elems;
    b.stride = layout->stride;
    b.n = b.rows * b.row_elems;
    detail::scan_bitmap(b.bitmap, b.n);
    b.values.get(std::max<size_t>(b.n * elem_, 1));
    // Slices of whole bitmap words, so that each finds the runs of its own.
    size_t slices = static_cast<size_t>(std::clamp<uint64_t>(b.n / kSliceElements, 1, most));
    const uint64_t step = (b.n / slices) & ~uint64_t{63};
    if (step == 0) slices = 1;
    b.segments.assign(slices, Segment{});
    if (b.pairs.size() < slices) b.pairs.resize(slices);
    for (size_t s = 0; s < slices; ++s) {
      // A slice's pairs take no more bytes than its elements (a varint is never longer than the
      // value it holds), nor, before it stops, more than the box's bitmap.
      const uint64_t elements = (s + 1 == slices ? b.n : (s + 1) * step) - s * step;
      b.pairs[s].get(std::min<uint64_t>((b.n + 7) / 8, elements) + detail::kRunsSlack);
      b.segments[s].first = s * step;
      b.segments[s].end = s + 1 == slices ? b.n : (s + 1) * step;
      jobs.push_back(Job{&b, s});
    }
    compared_bytes_ += b.n * elem_;
  }
  const auto* after = static_cast<const uint8_t*>(now.data());
  run_pieces(jobs.size(), [&](size_t j) {
    Box& b = *jobs[j].box;
    Segment& s = b.segments[jobs[j].segment];
    uint8_t* bitmap = b.bitmap.data();
    uint8_t* values = b.values.data() + s.first * elem_;
    uint8_t* v = values;
    bool rare = true;
    for (uint64_t e = s.first; e < s.end;) {
      const uint64_t row = e / b.row_elems, col = e % b.row_elems;
      const uint64_t len = std::min({s.end - e, b.row_elems - col, kChunkElements});
      const uint64_t at = (b.first + row * b.stride + col) * elem_;
      const uint64_t k = detail::scan_serial(old + at, after + at, len, elem_, xor_values, bitmap + e / 8, v, rare);
      if (keep && k != 0) std::memcpy(old + at, after + at, len * elem_);
      v += k * elem_;
      e += len;
    }
    s.count = static_cast<uint64_t>(v - values) / elem_;
    // Its runs, while its bitmap is in the core's cache; no more than the box's bitmap's bytes (past
    // those the bitmap encoding is the smaller).
    s.runs = detail::slice_runs(bitmap, s.first, s.end, (b.n + 7) / 8, b.pairs[jobs[j].segment].data());
  });
  for (size_t i = 0; i < used_; ++i) {
    Box& b = boxes_[i];
    b.changed = 0;
    for (const Segment& s : b.segments) b.changed += s.count;
  }
  return keep;
}

const TensorScan::Box* TensorScan::box_of(const Region& part) const {
  for (size_t i = 0; i < used_; ++i) {
    const Region& r = boxes_[i].region;
    if (r == part) return &boxes_[i];
    if (r.rank() == 0 || r.rank() != part.rank()) continue;
    bool rows = part.offset[0] >= r.offset[0] && part.offset[0] + part.size[0] <= r.offset[0] + r.size[0];
    for (int d = 1; d < r.rank() && rows; ++d) rows = part.offset[d] == r.offset[d] && part.size[d] == r.size[d];
    if (rows) return &boxes_[i];
  }
  return nullptr;
}

bool TensorScan::covers(const Region& part) const { return box_of(part) != nullptr; }

DeltaChoice TensorScan::encode(const Region& part, bool prefer_delta, std::vector<uint8_t>& out) const {
  const Box& b = *box_of(part);
  const uint64_t per_row =
      b.region.rank() == 0 ? b.n : b.n / static_cast<uint64_t>(std::max<int64_t>(b.region.size[0], 1));
  const uint64_t from = b.region.rank() == 0 ? 0 : static_cast<uint64_t>(part.offset[0] - b.region.offset[0]) * per_row;
  const uint64_t n = b.region.rank() == 0 ? b.n : static_cast<uint64_t>(part.size[0]) * per_row;
  const uint8_t* bitmap = b.bitmap.data();
  const uint8_t* all_values = b.values.data();
  const size_t map_bytes = (n + 7) / 8;
  thread_local detail::Scratch runs_memory, part_bitmap;
  uint8_t* runs = runs_memory.get(map_bytes + detail::kRunsSlack);
  // The part's bitmap (padded with clear bits to whole words), its values as the slices left them,
  // and its runs: a whole box's are its slices' joined; a part's are found in its bits.
  const uint8_t* map = bitmap;
  std::vector<ValueSpan> values;
  uint64_t k = 0;
  std::optional<std::pair<uint64_t, size_t>> found;
  if (from == 0 && n == b.n) {
    std::vector<detail::RunsSlice> slices(b.segments.size());
    std::vector<const uint8_t*> pairs(b.segments.size());
    for (size_t i = 0; i < b.segments.size(); ++i) {
      const Segment& s = b.segments[i];
      slices[i] = s.runs;
      pairs[i] = b.pairs[i].data();
      values.push_back(ValueSpan{all_values + s.first * elem_, s.count * elem_});
    }
    k = b.changed;
    found = detail::join_runs(slices.data(), pairs.data(), slices.size(), map_bytes, runs);
  } else {
    uint8_t* bits = detail::scan_bitmap(part_bitmap, static_cast<size_t>(n));
    for (uint64_t w = 0; w * 64 < n; ++w) {
      uint64_t x = bits_at(bitmap, from + w * 64);
      if (n - w * 64 < 64) x &= (uint64_t{1} << (n - w * 64)) - 1;
      std::memcpy(bits + w * 8, &x, 8);
    }
    map = bits;
    for (const Segment& s : b.segments) {
      const uint64_t lo = std::max(s.first, from), hi = std::min(s.end, from + n);
      if (lo >= hi || s.count == 0) continue;
      const uint64_t skip = count_bits(bitmap, s.first, lo), take = count_bits(bitmap, lo, hi);
      values.push_back(ValueSpan{all_values + (s.first + skip) * elem_, take * elem_});
      k += take;
    }
    found = detail::runs_of(map, static_cast<size_t>(n), map_bytes, runs);
  }
  const DeltaChoice choice =
      encode_found(map, values, k, static_cast<size_t>(n), elem_, prefer_delta, found, runs, out);
  runs_memory.trim();
  part_bitmap.trim();
  return choice;
}

}  // namespace ferry::dataplane

#include "sharding/spec_check.h"

#include <algorithm>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "sharding/scheme_check.h"

namespace ferry::sharding {
namespace {

std::string describe(const SourceTensor& t) { return fmt::format("{}{}", dtype_name(t.dtype), shape_to_string(t.shape)); }

// Destination boxes of a parameter's slices, flat: box i's offsets at [2 * dims * i, + dims), its
// sizes right after. Reused from one parameter to the next.
thread_local std::vector<int64_t> t_boxes;
thread_local std::vector<uint32_t> t_order;

bool boxes_overlap(const int64_t* a, const int64_t* b, size_t dims) {
  for (size_t k = 0; k < dims; ++k) {
    const int64_t as = a[dims + k], bs = b[dims + k];
    if (as == 0 || bs == 0) return false;
    if (a[k] + as <= b[k] || b[k] + bs <= a[k]) return false;
  }
  return true;
}

// True when no two boxes overlap: sorted by their start along a dimension where they do not all
// start together, each box is compared only with the boxes that start before it ends there.
bool boxes_disjoint(size_t n, size_t dims) {
  if (n < 2 || dims == 0) return n < 2;
  const int64_t* box = t_boxes.data();
  const size_t stride = 2 * dims;
  size_t sweep = 0;
  for (size_t k = 0; k < dims; ++k) {
    bool differ = false;
    for (size_t i = 1; i < n && !differ; ++i) differ = box[i * stride + k] != box[k];
    if (differ) {
      sweep = k;
      break;
    }
  }
  auto start = [&](uint32_t i) { return box[i * stride + sweep]; };
  t_order.resize(n);
  std::iota(t_order.begin(), t_order.end(), 0u);
  if (!std::is_sorted(t_order.begin(), t_order.end(), [&](uint32_t a, uint32_t b) { return start(a) < start(b); })) {
    std::sort(t_order.begin(), t_order.end(), [&](uint32_t a, uint32_t b) { return start(a) < start(b); });
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t* a = box + t_order[i] * stride;
    const int64_t end = a[sweep] + a[dims + sweep];
    for (size_t j = i + 1; j < n; ++j) {
      const int64_t* b = box + t_order[j] * stride;
      if (b[sweep] >= end) break;
      if (boxes_overlap(a, b, dims)) return false;
    }
  }
  return true;
}

// The checks of first_slice_error(), true when all pass.
bool slices_fit(const ParamSpec& p, std::span<const Shape* const> shapes) {
  const size_t n = p.slices.size(), dims = p.shape.size();
  t_boxes.resize(n * 2 * dims);
  int64_t covered = 0;
  for (size_t i = 0; i < n; ++i) {
    const SourceSlice& s = p.slices[i];
    if (shapes[i] == nullptr || !s.src.inside(*shapes[i])) return false;
    if (s.dst_offset.size() != dims || s.src.size.size() > dims) return false;
    int64_t* off = t_boxes.data() + i * 2 * dims;
    int64_t* size = off + dims;
    const size_t lead = dims - s.src.size.size();  // leading unit dimensions
    int64_t numel = 1;
    for (size_t d = 0; d < dims; ++d) {
      off[d] = s.dst_offset[d];
      size[d] = d < lead ? 1 : s.src.size[d - lead];
      if (off[d] < 0 || size[d] < 0 || size[d] > p.shape[d] || off[d] > p.shape[d] - size[d]) return false;
      numel *= size[d];
    }
    covered += numel;
  }
  return boxes_disjoint(n, dims) && covered <= shape_numel(p.shape);
}

// A rank laid out like rank d, whose names give hints: the same TP rank of the previous replica,
// else the rank before.
int alike(const std::vector<RankSpec>& ranks, size_t d) {
  if (d == 0) return -1;
  const RankSpec& r = ranks[d];
  const size_t tp = r.tp_size > 0 ? static_cast<size_t>(r.tp_size) : 0;
  if (tp > 0 && d >= tp && ranks[d - tp].tp_rank == r.tp_rank && ranks[d - tp].tp_size == r.tp_size) {
    return static_cast<int>(d - tp);
  }
  return static_cast<int>(d - 1);
}

// Flat per-rank lists of manifest indices, and the hint for the j-th entry of rank d.
struct Resolved {
  std::vector<int> index;
  std::vector<size_t> begin;  // rank d's entries: [begin[d], begin[d + 1])
  int hint(int ref, size_t j) const {
    if (ref >= 0 && j < begin[static_cast<size_t>(ref) + 1] - begin[static_cast<size_t>(ref)]) {
      return index[begin[static_cast<size_t>(ref)] + j];
    }
    return j > 0 ? index.back() + 1 : 0;
  }
};

}  // namespace

NameIndex::NameIndex(const Manifest& manifest) : manifest_(manifest) {
  map_.reserve(manifest.size());
  for (size_t i = 0; i < manifest.size(); ++i) {
    if (!map_.emplace(manifest[i].name, static_cast<int>(i)).second && duplicate_ == nullptr) {
      duplicate_ = &manifest[i].name;
    }
  }
}

Status check_param_slices(const ParamSpec& p, std::span<const Shape* const> source_shapes) {
  if (slices_fit(p, source_shapes)) return ok_status();
  return first_slice_error(p, source_shapes);
}

Status first_slice_error(const ParamSpec& p, std::span<const Shape* const> source_shapes) {
  std::vector<Region> dsts;
  int64_t covered = 0;
  for (size_t i = 0; i < p.slices.size(); ++i) {
    const SourceSlice& s = p.slices[i];
    const Shape* shape = source_shapes[i];
    if (shape == nullptr) {
      return Status::invalid_argument(fmt::format("{}: source tensor {} is not in the manifest", p.name, s.source));
    }
    if (!s.src.inside(*shape)) {
      return Status::out_of_range(fmt::format("{}: region {} lies outside source {} of shape {}", p.name,
                                              s.src.to_string(), s.source, shape_to_string(*shape)));
    }
    if (s.dst_offset.size() != p.shape.size() || s.src.size.size() > p.shape.size()) {
      return Status::invalid_argument(fmt::format("{}: slice from {} has rank {} for a destination of rank {}", p.name,
                                                  s.source, s.src.size.size(), p.shape.size()));
    }
    Region d = slice_dst_region(s, p);
    if (!d.inside(p.shape)) {
      return Status::out_of_range(fmt::format("{}: slice from {} lands at {} outside {}", p.name, s.source,
                                              d.to_string(), shape_to_string(p.shape)));
    }
    for (const Region& o : dsts) {
      if (o.overlaps(d)) {
        return Status::invalid_argument(fmt::format("{}: slices overlap at {} and {}", p.name, o.to_string(), d.to_string()));
      }
    }
    covered += d.numel();
    dsts.push_back(std::move(d));
  }
  if (covered > shape_numel(p.shape)) return Status::internal(p.name + ": slices cover more than the parameter");
  return ok_status();
}

Status check_and_resolve(const Manifest& manifest, const std::vector<RankSpec>& ranks, const NameIndex& index,
                         std::vector<int>* slice_sources) {
  if (index.duplicate() != nullptr) return Status::invalid_argument("trainer sends " + *index.duplicate() + " twice");
  std::vector<char> expected(manifest.size(), 0);
  std::vector<int> expected_by(manifest.size(), -1);  // the last rank that expects each tensor
  Resolved expects, slices;
  expects.begin.assign(ranks.size() + 1, 0);
  slices.begin.assign(ranks.size() + 1, 0);
  std::vector<const Shape*> shapes;
  // A rank sharing an earlier rank's tensors and parameters (a copy of its spec, as an identical
  // replica's rank is) passes the same checks and resolves to the same indices: they are copied.
  std::map<std::pair<const void*, const void*>, size_t> checked;
  auto copy_rank = [](Resolved& x, size_t from, size_t d) {
    const size_t at = x.index.size(), first = x.begin[from], last = x.begin[from + 1];
    x.index.resize(at + (last - first));
    std::copy(x.index.begin() + static_cast<ptrdiff_t>(first), x.index.begin() + static_cast<ptrdiff_t>(last),
              x.index.begin() + static_cast<ptrdiff_t>(at));
    x.begin[d + 1] = x.index.size();
  };
  for (size_t d = 0; d < ranks.size(); ++d) {
    const RankSpec& r = ranks[d];
    // (Vectors without a buffer are empty, and alike too.)
    if (auto [twin, added] = checked.try_emplace({r.expects.identity(), r.params.identity()}, d); !added) {
      copy_rank(expects, twin->second, d);
      copy_rank(slices, twin->second, d);
      continue;
    }
    const int ref = alike(ranks, d);
    for (size_t j = 0; j < r.expects.size(); ++j) {
      const SourceTensor& e = r.expects[j];
      const int i = index.find(e.name, expects.hint(ref, j));
      if (i < 0) {
        return Status::invalid_argument(fmt::format("tensor {}: replica {} rank {} expects {}, trainer sends nothing",
                                                    e.name, r.replica, r.tp_rank, describe(e)));
      }
      const SourceTensor& t = manifest[static_cast<size_t>(i)];
      if (t.dtype != e.dtype || t.shape != e.shape) {
        return Status::invalid_argument(fmt::format("tensor {}: replica {} rank {} expects {}, trainer sends {}", e.name,
                                                    r.replica, r.tp_rank, describe(e), describe(t)));
      }
      expected[static_cast<size_t>(i)] = 1;
      expected_by[static_cast<size_t>(i)] = static_cast<int>(d);
      expects.index.push_back(i);
    }
    expects.begin[d + 1] = expects.index.size();
    // Each rank's parameters against the tensors it expects (validate_rank_spec(r, r.expects)).
    size_t j = 0;
    for (const ParamSpec& p : r.params) {
      FERRY_RETURN_IF_ERROR(check_scheme_shape(p));
      // gptq_int4 loads a GPTQ checkpoint's qweight, scales and g_idx (reload::load_checkpoint);
      // a trainer's full-precision tensors would land on its packed codes.
      if (p.scheme == Scheme::kGptqInt4 && !p.slices.empty()) {
        return Status::invalid_argument(fmt::format(
            "tensor {}: replica {} rank {} keeps it as gptq_int4 ({}), which loads a GPTQ checkpoint (qweight, "
            "scales, g_idx) with load_checkpoint, not a trainer's weights; for weights a trainer sends use "
            "int4_group",
            p.slices.front().source, r.replica, r.tp_rank, p.name));
      }
      shapes.clear();
      for (const SourceSlice& s : p.slices) {
        const int i = index.find(s.source, slices.hint(ref, j++));
        const bool here = i >= 0 && expected_by[static_cast<size_t>(i)] == static_cast<int>(d);
        shapes.push_back(here ? &manifest[static_cast<size_t>(i)].shape : nullptr);
        slices.index.push_back(i);
      }
      FERRY_RETURN_IF_ERROR(check_param_slices(p, shapes));
    }
    slices.begin[d + 1] = slices.index.size();
  }
  for (size_t i = 0; i < manifest.size(); ++i) {
    if (!expected[i]) {
      return Status::invalid_argument(fmt::format("tensor {}: trainer sends {}, but no replica has a tensor of that name",
                                                  manifest[i].name, describe(manifest[i])));
    }
  }
  if (slice_sources != nullptr) *slice_sources = std::move(slices.index);
  return ok_status();
}

}  // namespace ferry::sharding

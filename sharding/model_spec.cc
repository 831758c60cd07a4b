#include "sharding/model_spec.h"

#include <string_view>
#include <unordered_map>

#include <fmt/format.h>

#include "sharding/scheme_check.h"
#include "sharding/spec_check.h"

namespace ferry::sharding {

Region slice_dst_region(const SourceSlice& slice, const ParamSpec& param) {
  // The source box's extent, right-aligned into the destination's rank (leading dims of size 1).
  Region r;
  r.offset = slice.dst_offset;
  r.size.assign(param.shape.size(), 1);
  const size_t src_rank = slice.src.size.size();
  const size_t dst_rank = param.shape.size();
  for (size_t i = 0; i < src_rank && i < dst_rank; ++i) {
    r.size[dst_rank - 1 - i] = slice.src.size[src_rank - 1 - i];
  }
  return r;
}

Status validate_rank_spec(const RankSpec& spec, const Manifest& manifest) {
  std::unordered_map<std::string_view, const SourceTensor*> by_name;
  by_name.reserve(manifest.size());
  for (const auto& t : manifest) by_name[t.name] = &t;
  std::vector<const Shape*> shapes;
  for (const ParamSpec& p : spec.params) {
    FERRY_RETURN_IF_ERROR(check_scheme_shape(p));
    shapes.clear();
    for (const SourceSlice& s : p.slices) {
      auto it = by_name.find(s.source);
      shapes.push_back(it == by_name.end() ? nullptr : &it->second->shape);
    }
    FERRY_RETURN_IF_ERROR(check_param_slices(p, shapes));
  }
  return ok_status();
}

bool share_layout(RankSpec& spec, const RankSpec& other) {
  // Parameters first: they differ more often, and a mismatch is found before the tensors are read.
  return spec.params.share_if_equal(other.params) && spec.expects.share_if_equal(other.expects);
}

bool share_with_alike(RankSpec& spec, std::span<const RankSpec* const> others) {
  for (const RankSpec* other : others) {
    if (other != &spec && other->tp_rank == spec.tp_rank && other->tp_size == spec.tp_size &&
        other->ep_size == spec.ep_size && share_layout(spec, *other)) {
      return true;
    }
  }
  return false;
}

std::string layer_of(const std::string& name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (name.starts_with(kPrefix)) {
    const size_t dot = name.find('.', kPrefix.size());
    return name.substr(0, dot);
  }
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

int layer_index_of(const std::string& name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return -1;
  int v = 0;
  size_t i = kPrefix.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) v = v * 10 + (name[i] - '0');
  return v;
}

}  // namespace ferry::sharding

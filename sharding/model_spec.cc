#include "sharding/model_spec.h"

#include <map>

#include <fmt/format.h>

#include "sharding/scheme_check.h"

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
  std::map<std::string, const SourceTensor*> by_name;
  for (const auto& t : manifest) by_name[t.name] = &t;
  for (const ParamSpec& p : spec.params) {
    FERRY_RETURN_IF_ERROR(check_scheme_shape(p));
    std::vector<Region> dsts;
    int64_t covered = 0;
    for (const SourceSlice& s : p.slices) {
      auto it = by_name.find(s.source);
      if (it == by_name.end()) {
        return Status::invalid_argument(fmt::format("{}: source tensor {} is not in the manifest", p.name, s.source));
      }
      if (!s.src.inside(it->second->shape)) {
        return Status::out_of_range(fmt::format("{}: region {} lies outside source {} of shape {}", p.name,
                                                s.src.to_string(), s.source, shape_to_string(it->second->shape)));
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
          return Status::invalid_argument(
              fmt::format("{}: slices overlap at {} and {}", p.name, o.to_string(), d.to_string()));
        }
      }
      covered += d.numel();
      dsts.push_back(std::move(d));
    }
    if (covered > shape_numel(p.shape)) return Status::internal(p.name + ": slices cover more than the parameter");
  }
  return ok_status();
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

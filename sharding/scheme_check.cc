#include "sharding/scheme_check.h"

#include <string>

#include <fmt/format.h>

namespace ferry::sharding {
namespace {

std::string sources_of(const ParamSpec& p) {
  std::string out;
  for (const SourceSlice& s : p.slices) {
    if (out.find(s.source) != std::string::npos) continue;
    if (!out.empty()) out += ", ";
    out += s.source;
  }
  return out.empty() ? "no source" : out;
}

}  // namespace

Status check_scheme_shape(const ParamSpec& p) {
  if (p.scheme == Scheme::kNone) return ok_status();
  if (p.shape.size() < 2) {
    return Status::invalid_argument(fmt::format("{} (from {}): scheme {} needs a matrix, the shard has shape {}", p.name,
                                                sources_of(p), scheme_name(p.scheme), shape_to_string(p.shape)));
  }
  const int64_t cols = p.shape.back();
  const int64_t group = scheme_group_columns(p.scheme);
  if (group > 0 && cols % group != 0) {
    return Status::invalid_argument(fmt::format(
        "{} (from {}): {} groups {} input columns, but this rank's shard {} has {} columns", p.name, sources_of(p),
        scheme_name(p.scheme), group, shape_to_string(p.shape), cols));
  }
  return ok_status();
}

}  // namespace ferry::sharding

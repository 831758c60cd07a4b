#include "sharding/scheme_check.h"

#include <array>
#include <string>

#include <fmt/format.h>

namespace ferry::sharding {
namespace {

constexpr std::array<std::string_view, 7> kSchemes = {"none",           "fp8_per_tensor", "fp8_per_channel", "fp8_block",
                                                      "int8_per_channel", "int4_group",   "gptq_int4"};

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

bool is_known_scheme(std::string_view scheme) {
  for (auto s : kSchemes) {
    if (s == scheme) return true;
  }
  return false;
}

int scheme_weight_bits(std::string_view scheme, DType source_dtype) {
  if (scheme == "none") return dtype_bits(source_dtype);
  if (scheme == "int4_group" || scheme == "gptq_int4") return 4;
  return 8;
}

Status check_scheme_shape(const ParamSpec& p) {
  if (!is_known_scheme(p.scheme)) {
    return Status::invalid_argument(fmt::format("{} (from {}): unknown quantization scheme '{}'", p.name, sources_of(p), p.scheme));
  }
  if (p.scheme == "none") return ok_status();
  if (p.shape.size() < 2) {
    return Status::invalid_argument(fmt::format("{} (from {}): scheme {} needs a matrix, the shard has shape {}", p.name,
                                                sources_of(p), p.scheme, shape_to_string(p.shape)));
  }
  const int64_t cols = p.shape.back();
  if ((p.scheme == "int4_group" || p.scheme == "gptq_int4") && cols % kSchemeGroupColumns != 0) {
    return Status::invalid_argument(fmt::format(
        "{} (from {}): {} groups {} input columns, but this rank's shard {} has {} columns", p.name, sources_of(p),
        p.scheme, kSchemeGroupColumns, shape_to_string(p.shape), cols));
  }
  return ok_status();
}

}  // namespace ferry::sharding

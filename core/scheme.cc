#include "core/scheme.h"

#include <string>

namespace ferry {

std::string_view scheme_name(Scheme scheme) {
  switch (scheme) {
    case Scheme::kNone: return "none";
    case Scheme::kFp8PerTensor: return "fp8_per_tensor";
    case Scheme::kFp8PerChannel: return "fp8_per_channel";
    case Scheme::kFp8Block: return "fp8_block";
    case Scheme::kInt8PerChannel: return "int8_per_channel";
    case Scheme::kInt4Group: return "int4_group";
    case Scheme::kGptqInt4: return "gptq_int4";
  }
  return "unknown";
}

Result<Scheme> parse_scheme(std::string_view name) {
  std::string names;
  for (Scheme s : kAllSchemes) {
    if (scheme_name(s) == name) return s;
    names += names.empty() ? "" : " ";
    names += scheme_name(s);
  }
  return Status::invalid_argument("unknown quantization scheme '" + std::string(name) + "' (expected one of " + names +
                                  ")");
}

std::string_view engine_layout_name(EngineLayout layout) {
  switch (layout) {
    case EngineLayout::kFerry: return "ferry";
    case EngineLayout::kVllm: return "vllm";
    case EngineLayout::kSglang: return "sglang";
  }
  return "unknown";
}

Result<EngineLayout> parse_engine_layout(std::string_view name) {
  for (EngineLayout l : kAllEngineLayouts) {
    if (engine_layout_name(l) == name) return l;
  }
  return Status::invalid_argument("unknown engine layout '" + std::string(name) + "' (expected ferry, vllm or sglang)");
}

bool scheme_is_online(Scheme scheme) { return scheme != Scheme::kGptqInt4; }

int64_t scheme_group_columns(Scheme scheme) {
  return scheme == Scheme::kInt4Group || scheme == Scheme::kGptqInt4 ? kGroupSize : 0;
}

int scheme_weight_bits(Scheme scheme, DType source_dtype) {
  switch (scheme) {
    case Scheme::kNone: return dtype_bits(source_dtype);
    case Scheme::kInt4Group:
    case Scheme::kGptqInt4: return 4;
    default: return 8;
  }
}

}  // namespace ferry

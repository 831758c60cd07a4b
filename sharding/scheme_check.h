// Which parameter shapes a quantization scheme can take. sharding/ sees only core/, so the grouping
// rules of kernels/quantize.h are restated here; a shard that breaks them is refused at planning
// time, naming the parameter and its sources, instead of failing inside a processing kernel.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

inline constexpr int64_t kSchemeGroupColumns = 128;  // int4_group and gptq_int4: columns per scale group

bool is_known_scheme(std::string_view scheme);
// Bits per element of a scheme's main storage tensor (16 for "none" of bf16), for wire estimates.
int scheme_weight_bits(std::string_view scheme, DType source_dtype);

// Checks that `param`'s shape (this rank's shard) suits its scheme.
Status check_scheme_shape(const ParamSpec& param);

}  // namespace ferry::sharding

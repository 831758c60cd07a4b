// Which parameter shapes a quantization scheme can take. A shard that breaks a scheme's grouping
// (core/scheme.h) is refused at planning time, naming the parameter and its sources, instead of
// failing inside a processing kernel.
#pragma once

#include "core/status.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

// Checks that `param`'s shape (this rank's shard) suits its scheme.
Status check_scheme_shape(const ParamSpec& param);

}  // namespace ferry::sharding

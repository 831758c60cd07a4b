// The DeepSeek-V3 layout (DeepseekV3ForCausalLM: DeepSeek-V3, DeepSeek-R1, Kimi-K2): MLA attention,
// routed experts behind `first_k_dense_replace` dense layers, shared experts. One mapping (the
// format of sharding/mapping.h) whose sizes come from the config.json.
#pragma once

#include "core/status.h"
#include "sharding/layout.h"
#include "sharding/model_config.h"

namespace ferry::sharding {

// `cfg.family` is deepseek_v3 and its MLA sizes are set (parse_hf_config checks them).
Result<ModelDesc> describe_deepseek_v3(const ModelConfig& cfg);

}  // namespace ferry::sharding

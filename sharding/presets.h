// Named models for `ferry plan --model` and for tests: the Hugging Face config.json of each dense and
// MoE family, Kimi-K2 (DeepSeek-V3 architecture: MLA attention, 384 experts) among them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "sharding/layout.h"

namespace ferry::sharding {

std::vector<std::string> preset_names();
// The preset's source text, a config.json.
Result<std::string> preset_text(std::string_view name);
Result<ModelDesc> preset_model(std::string_view name);

// A config.json or a mapping file's text, told apart by the "ferry_mapping" key.
Result<ModelDesc> model_from_json(std::string_view text);
Result<ModelDesc> model_from_file(const std::string& path);

}  // namespace ferry::sharding
